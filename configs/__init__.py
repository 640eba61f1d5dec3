# Makes this folder the package autotuner.configs (setup.py), so it ships in the wheel and Hydra can
# also reach it as pkg://autotuner.configs. It holds only YAML: nothing here is imported to run.
