"""A model folder damaged on disk (a download cut short, a file overwritten, JSON edited by hand) stops the engine with
an EngineError naming the file and the fix, as a missing file does: the worker and `lorabatch generate` print one
`error:` line and exit 2, where a SafetensorError, a JSONDecodeError or an AttributeError ended them in a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.api import EngineError
from engine.config import EngineConfig
from engine.engine import Engine


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(5000)


def _write(text: str):
    return lambda path: path.write_text(text)


# (file of the folder, what is done to it): each leaves a folder whose every file is present.
DAMAGES = [
    ("model.safetensors", _truncate),
    ("model.safetensors", lambda path: path.write_bytes(os.urandom(4096))),
    ("model.safetensors", _write("")),
    ("config.json", _write("[1, 2]")),
    ("generation_config.json", _write("{bad")),
    ("generation_config.json", _write('{"eos_token_id": "two"}')),
    ("generation_config.json", _write("[]")),
    ("tokenizer.json", _write('{"x": 1}')),
    ("tokenizer.json", lambda path: path.write_bytes(b"\xff\xfe{")),
    ("tokenizer_config.json", _write("{bad")),
    ("tokenizer_config.json", _write('"text"')),
    ("model.safetensors.index.json", _write("{bad")),
    ("model.safetensors.index.json", _write('{"metadata": {}}')),
    ("model.safetensors.index.json", _write('{"weight_map": ["model.safetensors"]}')),
]


@pytest.fixture
def model_copy(tmp_path, demo_set) -> Path:
    model = tmp_path / "model"
    shutil.copytree(demo_set["model"], model)
    return model


@pytest.mark.parametrize("name,damage", DAMAGES)
def test_a_damaged_file_of_the_model_folder_is_named(model_copy, name, damage):
    """Every damaged file is an EngineError of code model_invalid whose message names that file."""
    damage(model_copy / name)
    with pytest.raises(EngineError) as e:
        Engine(EngineConfig(model_dir=str(model_copy), device="cpu"))
    assert e.value.code == "model_invalid", e.value
    assert str(model_copy / name) in str(e.value), e.value


def test_generate_on_a_truncated_safetensors_is_one_error_line(tmp_path, model_copy):
    """The command line says it as it says a missing file: one `error:` line, status 2, the fix."""
    _truncate(model_copy / "model.safetensors")
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt": "hi"}\n')
    env = {k: v for k, v in os.environ.items() if k != "LORABATCH_CONFIG"}
    out = subprocess.run([sys.executable, "-m", "consumer.cli", "generate", "--jobs", str(jobs), "--model", str(model_copy)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, (out.returncode, out.stderr)
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "model.safetensors" in lines[0] and "set engine.model_dir (or --model)" in lines[0], lines[0]
