"""The model set-up: case files to a HuggingFace config (cases), the documented HF -> Megatron mapping
(hf_to_megatron), Megatron's GPTModel built with the parts the ops need and instrumented (build), the
bridges that let Megatron-Core run without CUDA (cpu_bridges), and devices, dtypes, seeding and the
process group (runtime). It imports nothing from the runner, the launchers, the results or the entry
points."""
