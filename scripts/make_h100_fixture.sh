#!/usr/bin/env bash
# The H100 fixture of Megatron-LM's published runs (tests/fixtures/h100_megatron_gpt), on one lent H100:
#
#   bash scripts/make_h100_fixture.sh [OUT_DIR]     (default gpu_check_out/; under 10 minutes)
#
# The calibration, then one emulated-rank layer of each of the four GPTs and the benchmark from them:
# scripts/gpu_check.sh's steps calibrate and fixture_* (it says what each profiles). OUT_DIR gets the
# fixture (h100_megatron_gpt/: copy it to tests/fixtures/), megatron_published.txt (the benchmark's
# table), summary.txt and runs.tar.gz.
set -u
export GPU_CHECK_STEPS='calibrate fixture_*' GPU_CHECK_DEADLINE_S=${GPU_CHECK_DEADLINE_S:-540}
exec bash "$(dirname "$0")/gpu_check.sh" "$@"
