"""A complete checkpoint: every shard of the index there and whole — checked by
``check_checkpoint``, by ``sparkd plan`` and by the launch preflight (issue 19)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoints import disk_bytes, gib, make_checkpoint, write_shard
from click.testing import CliRunner
from test_kvcache import LLAMA_31_8B

from sparkd.errors import InvalidInput
from sparkd.face.cli import main
from sparkd.ops.preflight import run_preflight
from sparkd.sense.checkpoint import check_checkpoint, read_model_config

SHARDS = [gib(5), gib(5), gib(4.9)]  # ~15 GiB of BF16 tensors, sparse on disk


def test_a_complete_checkpoint_passes(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", LLAMA_31_8B, SHARDS)
    c = check_checkpoint(d)
    assert c.ok and c.problems == () and c.shards == 3
    # the tensor bytes are counted from the headers, equal to the index's total_size
    assert c.data_bytes == c.total_size_bytes == sum(SHARDS)
    assert "complete: 3 shards of model.safetensors.index.json" in c.describe()
    # the shards are holes: the test writes headers, not 15 GiB
    assert disk_bytes(d) < 1_000_000


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", LLAMA_31_8B, SHARDS)
    (d / "model-00002-of-00003.safetensors").unlink()
    c = check_checkpoint(d)
    assert not c.ok
    assert c.missing == ("model-00002-of-00003.safetensors",)
    assert "1 of 3 shards named in model.safetensors.index.json missing: model-00002-of-00003.safetensors" in (
        c.describe()
    )


def test_a_truncated_shard_is_named_with_its_sizes(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", LLAMA_31_8B, SHARDS)
    f = d / "model-00003-of-00003.safetensors"
    with f.open("r+b") as fh:  # an interrupted download: the tail is missing
        fh.truncate(f.stat().st_size - 4096)
    c = check_checkpoint(d)
    assert not c.ok
    assert c.truncated == (("model-00003-of-00003.safetensors", SHARDS[2] - 4096, SHARDS[2]),)
    assert "tensor bytes found" in c.describe() and "< metadata.total_size" in c.describe()


def test_fewer_tensor_bytes_than_the_index_total_is_refused(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", LLAMA_31_8B, SHARDS, total_size=sum(SHARDS) + 2)
    c = check_checkpoint(d)
    assert not c.ok and f"tensor bytes found {sum(SHARDS)} < metadata.total_size {sum(SHARDS) + 2}" in c.describe()


def test_more_tensor_bytes_than_the_index_total_is_accepted(tmp_path: Path) -> None:
    # writers differ in how they count tied/quantised tensors; only a shortfall means data is missing
    d = make_checkpoint(tmp_path / "m", LLAMA_31_8B, SHARDS, total_size=sum(SHARDS) - 1024)
    assert check_checkpoint(d).ok


def test_a_single_file_checkpoint_without_index_is_checked_by_its_header(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    write_shard(d / "model.safetensors", 1024)
    assert check_checkpoint(d).ok and check_checkpoint(d).index is None
    (d / "model.safetensors").write_bytes(b"\x10\x00")  # not even a header length
    c = check_checkpoint(d)
    assert not c.ok and "model.safetensors: not a readable safetensors file" in c.describe()


def test_a_broken_index_or_no_directory_is_invalid_input(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", LLAMA_31_8B, [1024])
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(InvalidInput, match="weight_map"):
        check_checkpoint(d)
    with pytest.raises(InvalidInput) as e:
        check_checkpoint(tmp_path / "nope")
    assert e.value.field == "checkpoint"


def test_read_model_config_names_the_file_and_the_flag(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as e:
        read_model_config(tmp_path)
    assert "config.json" in e.value.message and "does not exist" in e.value.message
    assert "--kv-bytes-per-token" in e.value.message
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(InvalidInput, match="holds a list, not an object"):
        read_model_config(tmp_path)


# --- sparkd plan ------------------------------------------------------------------


def _plan(tmp_path: Path, *args: str) -> tuple[int, str]:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "plan", "--mem-total-gib", "121.69", *args])
    return r.exit_code, r.output


def test_plan_refuses_an_incomplete_checkpoint_listing_the_missing_shard(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", LLAMA_31_8B, SHARDS)
    code, out = _plan(tmp_path, "--model-dir", str(d), "--max-model-len", "8192")
    assert code == 0, out  # complete: planned
    assert "complete: 3 shards" in out
    (d / "model-00002-of-00003.safetensors").unlink()
    code, out = _plan(tmp_path, "--model-dir", str(d), "--max-model-len", "8192", "--json")
    # refused (exit 1), naming the missing shard; no budget computed from the rest
    assert code == 1
    assert "missing: model-00002-of-00003.safetensors" in out and "incomplete" in out
    assert '"gmu"' not in out


def test_plan_json_says_the_checkpoint_is_complete(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", LLAMA_31_8B, SHARDS)
    code, out = _plan(tmp_path, "--model-dir", str(d), "--max-model-len", "8192", "--json")
    assert code == 0, out
    assert json.loads(out)["checkpoint"]["ok"] is True


# --- the launch preflight -------------------------------------------------------------


def _preflight(tmp_path: Path, model_dir: str | None):  # type: ignore[no-untyped-def]
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    return run_preflight(
        gmu=None, margin_bytes=0, running_managed=[], shm_dir=str(shm), clean_shm=False, model_dir=model_dir
    )


def test_the_preflight_refuses_an_incomplete_checkpoint(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "m", LLAMA_31_8B, SHARDS)
    ok = _preflight(tmp_path, str(d))
    assert ok.ok and any("complete: 3 shards" in n for n in ok.notes)
    (d / "model-00001-of-00003.safetensors").unlink()
    pf = _preflight(tmp_path, str(d))
    assert not pf.ok
    assert "missing: model-00001-of-00003.safetensors" in pf.failures[0]
    assert "vLLM would fail on it" in pf.failures[0]


def test_the_preflight_refuses_a_model_dir_that_is_not_there(tmp_path: Path) -> None:
    pf = _preflight(tmp_path, str(tmp_path / "nope"))
    assert not pf.ok and "checkpoint not readable" in pf.failures[0]
    # no model_dir configured: nothing to check
    assert _preflight(tmp_path, None).ok


def test_a_header_without_offsets_is_not_readable(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    raw = b'{"w": {"dtype": "BF16", "shape": [2]}}'
    (d / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 4)
    c = check_checkpoint(d)
    assert not c.ok and "tensor 'w' has no [begin, end] data_offsets" in c.describe()


def test_a_pytorch_bin_index_is_checked_for_its_shards(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "pytorch_model-00001-of-00002.bin").write_bytes(b"\0" * 64)
    doc = {
        "metadata": {"total_size": 10**9},
        "weight_map": {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"},
    }
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(doc))
    c = check_checkpoint(d)
    # the missing shard is named; pickle files have no header to size, so total_size is not compared
    assert c.missing == ("pytorch_model-00002-of-00002.bin",) and c.data_bytes is None
    (d / "pytorch_model-00002-of-00002.bin").write_bytes(b"\0" * 64)
    assert check_checkpoint(d).ok
