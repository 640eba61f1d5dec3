"""What pyproject.toml cannot say declaratively: the repository keeps ``cases/`` and ``configs/`` at its
top level (the design card's layout), and the package carries them as ``autotuner.cases`` and
``autotuner.configs``. A wheel holds them under ``autotuner/``; an editable install maps those names
back onto the checkout's folders. The code finds them through ``autotuner.shipped_folder``. The
calibration presets (``autotuner/results/presets/*.json``) and the cluster presets
(``autotuner/predict/clusters/*.json``) are package data of their modules.
Everything else (metadata, dependencies, console commands) is in pyproject.toml."""

from setuptools import find_packages, setup

SHIPPED = {"autotuner.cases": "cases", "autotuner.configs": "configs"}

setup(
    # Every package under autotuner/ as it is added, plus the two YAML folders (each has an __init__.py
    # so that an editable install's finder, and Hydra's pkg://, resolve it like any subpackage).
    packages=[*find_packages(include=["autotuner", "autotuner.*"]), *SHIPPED],
    package_dir=SHIPPED,
    package_data={
        "autotuner.cases": ["*.yaml", "hf/*/config.json"],
        "autotuner.configs": ["*.yaml", "*/*.yaml"],
        "autotuner.results": ["presets/*.json"],
        "autotuner.predict": ["clusters/*.json"],
    },
)
