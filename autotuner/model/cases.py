"""Model cases: a HuggingFace model config plus the shapes to profile.

A case is a YAML file ``<name>.yaml`` in the built-in ``cases/`` folder or in the user's
``case_dir``. It holds either the HF config fields inline (``hf_config:``) or a path to a local
folder with a ``config.json`` (``hf_config_dir:``, relative to the YAML file). The HF config object is
built with transformers' own config classes, offline: nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictStr, TypeAdapter, ValidationError, model_validator

from autotuner import shipped_folder
from autotuner.errors import UserError, schema_problem

BUILTIN_CASE_DIR = shipped_folder("cases")  # the repository's cases/, carried by the wheel too
# A case is named, never addressed by path: a name with a separator or a leading dot could load a file
# outside the case folders and put the default run directory (runs/${case}/...) outside runs/.
CASE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


@dataclass
class Case:
    """A model case as written on disk, before any override."""

    name: str
    hf_fields: dict[str, Any]
    shapes: dict[str, Any]
    path: Path
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def case_dirs(case_dir: str | None) -> list[Path]:
    """Folders searched for cases, the user's first so a user case can shadow a built-in one."""
    dirs = []
    if case_dir:
        user_dir = Path(case_dir).expanduser().resolve()
        if not user_dir.is_dir():
            raise UserError(
                f"case_dir {case_dir!r} is not a folder: point case_dir at a folder of case YAML files"
            )
        dirs.append(user_dir)
    dirs.append(BUILTIN_CASE_DIR)
    return dirs


def available_cases(case_dir: str | None = None) -> list[str]:
    """Names of every case that ``case=`` accepts."""
    names = set()
    for folder in case_dirs(case_dir):
        names.update(p.stem for p in folder.glob("*.yaml") if p.is_file())  # as load_case reads them
    return sorted(names)


def load_case(name: str, case_dir: str | None = None) -> Case:
    """Read one case file; unknown names and malformed files raise UserError."""
    if not isinstance(name, str) or not CASE_NAME.fullmatch(name):
        raise UserError(
            f"case={name!r} is not a case name (letters, digits, _, - and ., not leading): for a case "
            "file elsewhere pass case_dir=<its folder> case=<its file name without .yaml>"
        )
    for folder in case_dirs(case_dir):
        path = folder / f"{name}.yaml"
        if path.is_file():
            return _parse_case(name, path)
    raise UserError(
        f"unknown case {name!r}: choose one of {', '.join(available_cases(case_dir))}, "
        "or add <name>.yaml to a folder and pass case_dir=<folder>"
    )


class CaseFile(BaseModel):
    """The schema of a case YAML file. Exactly one of ``hf_config`` and ``hf_config_dir`` says where the
    HF config fields are; ``shapes`` seeds the ``shapes.*`` settings; ``notes`` is for people."""

    model_config = ConfigDict(extra="forbid")

    description: Annotated[str, Field(coerce_numbers_to_str=True)] = ""  # "description: 2" reads "2"
    hf_config: dict[StrictStr, Any] | None = None
    hf_config_dir: Annotated[str, Field(strict=True, min_length=1)] | None = None
    shapes: dict[str, Any] | None = None
    notes: Any = None

    @model_validator(mode="after")
    def _one_config_source(self) -> CaseFile:
        if (self.hf_config is None) == (self.hf_config_dir is None):
            raise ValueError(
                "give exactly one of hf_config (inline) or hf_config_dir (a folder with config.json)"
            )
        return self


# The fix for a problem in each field of a case file, the last part of its one-line refusal.
FIXES = {
    "hf_config": "write it as model_type: llama, hidden_size: 4096, ...",
    "hf_config_dir": "point it at a folder holding config.json",
    "shapes": "write it as seq_len: [...], micro_batch_size: [...] (generator, ... as in cases/tiny.yaml)",
    "description": "write it as one line of text",
}
HF_FIELDS = TypeAdapter(dict[StrictStr, Any])


def _refusal(subject: str, error: ValidationError) -> UserError:
    """One line: the file, the field and its problem, and the fix (the whole file's problem, "give
    exactly one of ...", says its fix itself)."""
    problems = error.errors(include_url=False)
    unknown = [str(p["loc"][0]) for p in problems if p["type"] == "extra_forbidden"]
    if unknown:
        return UserError(
            f"{subject}: unknown key(s) {', '.join(unknown)}: "
            f"allowed keys are {', '.join(CaseFile.model_fields)}"
        )
    field = str(problems[0]["loc"][0]) if problems[0]["loc"] else ""
    fix = f": {FIXES[field]}" if field in FIXES else ""
    return UserError(f"{subject}: {schema_problem(error)}{fix}")


def _parse_case(name: str, path: Path) -> Case:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise UserError(
            f"case file {path} is not valid YAML ({exc.__class__.__name__}): fix the file"
        ) from exc
    except UnicodeDecodeError:
        raise UserError(f"case file {path} is not UTF-8 text: save it as UTF-8 YAML") from None
    if not isinstance(data, dict):
        raise UserError(
            f"case file {path} must be a mapping, not {type(data).__name__}: "
            "write it as hf_config: {...} (or hf_config_dir: <folder>) and shapes: {...}"
        )
    try:
        case = CaseFile.model_validate(data)
    except ValidationError as exc:
        raise _refusal(f"case file {path}", exc) from None
    if case.hf_config is not None:
        hf_fields = case.hf_config
    else:
        assert case.hf_config_dir is not None  # the schema wants exactly one of the two
        hf_fields = _read_config_json(path, case.hf_config_dir)
    return Case(
        name=name,
        hf_fields=hf_fields,
        shapes=case.shapes or {},
        path=path,
        description=case.description,
    )


def _read_config_json(case_path: Path, folder: str) -> dict[str, Any]:
    """The HF config fields in ``hf_config_dir``'s config.json (the folder relative to the case file)."""
    config_json = (case_path.parent / folder).resolve() / "config.json"
    if not config_json.is_file():
        raise UserError(
            f"case file {case_path}: {config_json} does not exist: "
            "point hf_config_dir at a folder holding config.json"
        )
    try:
        data = json.loads(config_json.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(
            f"{config_json} is not valid JSON ({str(exc).splitlines()[0]}): fix the file or point "
            "hf_config_dir at a folder holding a model's config.json"
        ) from exc
    try:
        return HF_FIELDS.validate_python(data)
    except ValidationError as exc:
        raise UserError(f"{config_json} {schema_problem(exc)}: {FIXES['hf_config']}") from None


def build_hf_config(hf_fields: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """Build the transformers config object, applying ``hf.<field>=`` overrides first.

    An override of a field the config class does not know is an error, not a silent new attribute:
    transformers accepts any keyword and would store a typo without complaint.
    """
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    model_type = hf_fields.get("model_type")
    if not model_type:
        raise UserError("the case's HF config has no model_type: add model_type (e.g. llama) to hf_config")
    fields = {k: v for k, v in hf_fields.items() if k not in ("model_type", "transformers_version")}
    try:
        reference = AutoConfig.for_model(model_type)
    except ValueError as exc:
        raise UserError(
            f"unknown HF model_type {model_type!r}: use a model_type transformers knows (llama, mistral, ...)"
        ) from exc
    known_fields = set(reference.to_dict()) | set(fields) | {"head_dim", "rope_theta"}
    unknown = sorted(set(overrides) - known_fields)
    if unknown:
        raise UserError(
            f"unknown HF config field(s) {unknown} for model_type {model_type}: "
            "check the spelling of hf.<field> overrides"
        )
    fields.update(overrides)
    # transformers logs its own warnings about a bad field (a token id outside vocab_size=-1) before our
    # checks in autotuner.model.hf_to_megatron refuse it in one line: keep them off stderr while building.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # noqa: BLE001 - transformers validates (heads vs hidden size) with its own types
        root = exc.__cause__ or exc
        first = (str(root).strip().splitlines() or [type(root).__name__])[0]
        raise UserError(
            f"invalid HF config for case: {first}: fix the case file or the hf.<field> overrides"
        ) from exc
    finally:
        hf_logging.set_verbosity(verbosity)
