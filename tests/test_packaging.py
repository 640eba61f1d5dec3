"""Installed as a user installs it: an sdist built from the source, a wheel built from that sdist, the wheel
in a fresh virtual environment (no checkout on its path), and the console commands run from a folder
outside the checkout. Then the same package as an editable install, the development loop. Those are
marked slow; the checks of a user's own config folder also run in-process (fast).

One virtual environment serves the module: a fresh one, whose third-party packages are the development
environment's own, linked in (torch the exact build the development environment runs, never one pip
would choose), and our wheel installed into it by pip, which checks the wheel's requirements against
them. Installing torch and the rest afresh from the local package index took 45-60 s of the suite's 15
minutes on the 2-core development machine and tested pip, not the package.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# The console commands and the module each one is (pyproject.toml's [project.scripts]).
COMMANDS = {
    "autotuner": "autotuner.main",
    "autotuner-compare": "autotuner.compare",
    "autotuner-report": "autotuner.report",
    "autotuner-calibrate": "autotuner.calibrate",
    "autotuner-capture": "autotuner.capture",
    "autotuner-nsys-read": "autotuner.nsys_read",
    "autotuner-launcher-agreement": "autotuner.launcher_agreement",
    "autotuner-predict": "autotuner.predict",
    "autotuner-validate": "autotuner.validate",
    "autotuner-tune": "autotuner.tune",
}
TINY = ["shapes.seq_len=[16]", "shapes.micro_batch_size=[1]", "progress=false"]
# What a checkout holds besides its source (git-ignored installs, outputs, build folders): left out of
# the copy the packages are built from, so a stale build/ can never slip into the wheel.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", ".lock-venv", ".tools", "runs", "build", "dist", "*.egg-info", "__pycache__",
    ".pytest_cache", ".ruff_cache", ".whl", ".whl19", "gpu_check_out", "outputs", "multirun",
)  # fmt: skip


@dataclass(frozen=True)
class Dists:
    source: Path  # the clean copy of the checkout
    sdist: Path
    wheel: Path


@dataclass(frozen=True)
class Venv:
    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def python(self) -> str:
        return str(self.bin / "python")


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """A command as a user's shell runs it, with nothing of the checkout on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (
        f"{proc.args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def _shipped_yaml() -> set[str]:
    return {
        p.relative_to(REPO).as_posix()
        for folder in ("cases", "configs")
        for p in (REPO / folder).rglob("*.yaml")
    }


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> Dists:
    """The sdist, built from a clean copy of the checkout; the wheel, built from the unpacked sdist (as
    pip does from PyPI), so a file the sdist forgets is missing from the wheel too."""
    base = tmp_path_factory.mktemp("dists")
    source = base / "source"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCE)
    out = base / "dist"
    out.mkdir()
    sdist_name = (
        _ok(
            _run(
                [
                    sys.executable,
                    "-c",
                    f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))",
                ],
                source,
            )
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    sdist = out / sdist_name
    with tarfile.open(sdist) as archive:
        archive.extractall(base / "unpacked", filter="data")
    (unpacked,) = (base / "unpacked").iterdir()
    _ok(
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "-w",
                str(out),
                str(unpacked),
            ],
            base,
        )
    )
    (wheel,) = out.glob("*.whl")
    return Dists(source, sdist, wheel)


def _third_party(base: Path) -> Path:
    """A folder of links to this environment's installed packages, all but ours, and none of its
    ``.pth`` files (the editable install's finder, which would put the checkout on the path)."""
    site = Path(sysconfig.get_paths()["purelib"])
    ours = ("autotuner", "__editable__")
    folder = base / "third_party"
    folder.mkdir()
    for entry in site.iterdir():
        if entry.suffix != ".pth" and not entry.name.startswith(ours) and entry.name != "__pycache__":
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.fixture(scope="module")
def venv(dists, tmp_path_factory) -> Venv:
    """A fresh virtual environment with this environment's third-party packages (module docstring) and
    the wheel installed by pip, its requirements checked against them."""
    base = tmp_path_factory.mktemp("venv")
    env = Venv(base / "env")
    # from the base Python, without the pip and setuptools of its own (older ones, which would shadow the
    # linked ones torch requires)
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", str(env.root)], REPO))
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_ok(_run([env.python, "-c", code], base)).stdout.strip())
    (site / "third_party.pth").write_text(f"{_third_party(base)}\n")
    _ok(_run([env.python, "-m", "pip", "install", "-q", "--no-index", str(dists.wheel)], REPO, timeout=900))
    # torch is the development environment's build, and it was not reinstalled
    code = "import torch; print(torch.__version__, torch.__file__)"
    version, where = _ok(_run([env.python, "-c", code], base)).stdout.split()
    assert version == torch.__version__ and Path(where).is_relative_to(base / "third_party")
    return env


@pytest.mark.slow
def test_wheel_and_sdist_carry_the_cases_configs_and_commands(dists):
    with zipfile.ZipFile(dists.wheel) as wheel:
        names = set(wheel.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = wheel.read(entry_points).decode()
    assert {f"autotuner/{name}" for name in _shipped_yaml()} <= names
    assert "autotuner/configs/launcher/get_data.yaml" in names and "autotuner/cases/tiny.yaml" in names
    assert "autotuner/cases/hf/deepseek_v3/config.json" in names  # a published config a case points at
    # the calibration presets, package data of the module that reads them
    presets = {
        f"autotuner/results/presets/{p.name}" for p in (REPO / "autotuner/results/presets").glob("*.json")
    }
    assert presets and presets <= names
    clusters = {
        f"autotuner/predict/clusters/{p.name}" for p in (REPO / "autotuner/predict/clusters").glob("*.json")
    }
    assert clusters and clusters <= names
    # one top-level package, ours: cases/ and configs/ never land in site-packages under their own names
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"autotuner"}
    for command, module in COMMANDS.items():
        assert f"{command} = {module}" in scripts
    with tarfile.open(dists.sdist) as sdist:
        members = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert _shipped_yaml() <= members
    assert {
        "setup.py",
        "MANIFEST.in",
        "Makefile",
        "constraints.txt",  # the Makefile's set-up installs with it
        "scripts/install_nsys.sh",
        "scripts/gpu_check.sh",
        "scripts/slurm/profile_case.sbatch",
    } <= members


@pytest.mark.slow
def test_installed_commands_answer_help_from_outside_the_checkout(venv, tmp_path):
    where = _ok(
        _run(
            [
                venv.python,
                "-c",
                "import autotuner; print(autotuner.__file__); print(autotuner.shipped_folder('configs'))",
            ],
            tmp_path,
        )
    )
    package, configs = where.stdout.split()
    assert Path(package).is_relative_to(venv.root) and not Path(package).is_relative_to(REPO)
    assert Path(configs) == Path(package).parent / "configs"
    help_text = _ok(_run([str(venv.bin / "autotuner"), "--help"], tmp_path)).stdout
    assert "tiny" in help_text and "llama70b" in help_text and "Launchers (launcher=NAME" in help_text
    as_module = _ok(_run([venv.python, "-m", "autotuner.main", "--help"], tmp_path)).stdout
    assert as_module.replace("python -m autotuner.main", "autotuner") == help_text  # named as started
    for command, module in COMMANDS.items():
        if command == "autotuner":
            continue
        usage = _ok(_run([str(venv.bin / command), "--help"], tmp_path)).stdout
        assert "usage:" in usage.lower(), command
        assert "usage:" in _ok(_run([venv.python, "-m", module, "--help"], tmp_path)).stdout.lower()
    assert not list(tmp_path.iterdir())  # --help writes nothing
    # the presets, by name, from the installed package
    code = "from autotuner.results.calibration import load; print(load('h200')['preset']['measured'])"
    assert _ok(_run([venv.python, "-c", code], tmp_path)).stdout.strip() == "2026-12-04"


def _one_run(root: Path) -> Path:
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    return run_dir


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    with open(run_dir / "results.csv", newline="") as handle:
        assert [r["op"] for r in csv.DictReader(handle)] == [r["op"] for r in rows]
    return rows


@pytest.mark.slow
def test_installed_demo_case_dir_compare_and_report(venv, tmp_path):
    """The demo plan on the tiny case, a user's case in case_dir run by a launcher from a user's own
    config folder, then compare and report: every output under the working directory's runs/."""
    work = tmp_path / "work"
    work.mkdir()
    autotuner = str(venv.bin / "autotuner")

    _ok(_run([autotuner, "case=tiny", *TINY, "ops=[linear_qkv,mlp]"], work))
    demo = _one_run(work / "runs" / "tiny" / "get_data")
    rows = _rows(demo)
    assert {(r["op"], r["phase"]) for r in rows} == {
        (op, ph) for op in ("linear_qkv", "mlp") for ph in ("forward", "backward")
    }
    assert {r["status"] for r in rows} == {"ok"}
    assert (demo / "environment.json").is_file() and (demo / "report.html").is_file()

    cases, configs = tmp_path / "my_cases", tmp_path / "my_configs"
    cases.mkdir()
    (cases / "mini.yaml").write_text((REPO / "cases" / "tiny.yaml").read_text())
    (configs / "launcher").mkdir(parents=True)
    (configs / "launcher" / "quick.yaml").write_text("defaults:\n  - get_data\n")
    # Hydra's flags before the overrides (its parser takes the overrides as one trailing list)
    user = ["--config-dir", str(configs), f"case_dir={cases}", "case=mini", "launcher=quick"]
    _ok(_run([autotuner, *user, *TINY, "ops=[linear_qkv]", "report=false"], work))
    mine = _one_run(work / "runs" / "mini" / "get_data")
    assert {(r["op"], r["status"]) for r in _rows(mine)} == {("linear_qkv", "ok")}
    assert "launcher: quick" in (mine / ".hydra" / "hydra.yaml").read_text()
    assert not (mine / "report.html").exists()

    oss = work / "oss.json"
    table = _ok(
        _run([str(venv.bin / "autotuner-compare"), str(demo), str(mine), f"oss_json={oss}"], work)
    ).stdout
    assert "linear_qkv" in table and json.loads(oss.read_text())
    _ok(_run([str(venv.bin / "autotuner-report"), str(mine)], work))
    assert (mine / "report.html").is_file()
    _ok(_run([str(venv.bin / "autotuner-report"), str(demo), str(mine)], work))
    assert (_one_run(work / "runs" / "compare") / "report.html").is_file()  # the default out=: ./runs/
    # nothing written beside the installed package
    assert not list(venv.root.rglob("runs")) and not list(venv.root.rglob("results.jsonl"))


@pytest.mark.slow
def test_editable_install_reads_the_checkouts_folders(venv, dists, tmp_path):
    """`pip install -e .` (the development loop) maps autotuner.cases and autotuner.configs onto the
    checkout's top-level folders, so an edited case or config is used without reinstalling."""
    _ok(_run([venv.python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(dists.source)], tmp_path))
    code = (
        "import importlib.util, autotuner\n"
        "for name in ('cases', 'configs'):\n"
        "    print(importlib.util.find_spec('autotuner.' + name).origin, autotuner.shipped_folder(name))\n"
    )
    lines = _ok(_run([venv.python, "-c", code], tmp_path)).stdout.splitlines()
    for line, name in zip(lines, ("cases", "configs"), strict=True):
        origin, folder = line.split()
        assert Path(origin) == dists.source / name / "__init__.py" and Path(folder) == dists.source / name
    (dists.source / "cases" / "edited.yaml").write_text((REPO / "cases" / "tiny.yaml").read_text())
    assert "edited" in _ok(_run([str(venv.bin / "autotuner"), "--help"], tmp_path)).stdout


def test_a_user_config_dir_is_searched_before_any_work(tmp_path, capsys):
    """A launcher YAML in ``--config-dir`` (or ``hydra.searchpath``) passes the checks that run before
    Hydra does, as it passes Hydra's own composition; a config folder that is not there is one line."""
    from autotuner.errors import UserError
    from autotuner.main import parse_command_line, preflight, run

    (tmp_path / "launcher").mkdir()
    (tmp_path / "launcher" / "quick.yaml").write_text("defaults:\n  - get_data\n")
    job = ["case=tiny", "launcher=quick", *TINY]
    with pytest.raises(UserError, match="unknown launcher"):
        preflight(parse_command_line(job))
    preflight(parse_command_line(["--config-dir", str(tmp_path), *job]))
    preflight(parse_command_line([f"--config-dir={tmp_path}", *job]))
    preflight(parse_command_line([f"hydra.searchpath=[file://{tmp_path}]", *job]))

    missing = tmp_path / "nowhere"
    assert run(["--config-dir", str(missing), *job]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--config-dir {missing} is not a folder" in err
    assert run(["hydra.searchpath=file:///x", *job]) == 2
    assert "give a list of folders" in capsys.readouterr().err
