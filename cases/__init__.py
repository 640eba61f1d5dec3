# Makes this folder the package autotuner.cases (setup.py), so the shipped cases travel in the wheel.
# It holds only YAML files (autotuner.model.cases reads them); nothing here is imported to run.
