"""`eaglepipe verify` beyond the hidden states, on real files: sealed drafter files, regenerated
rows against their manifest (restored from the journal, or set aside), the prepared table
against its summary. The whole command on a finished run is in test_finished_run.py and
test_regenerate.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT
from safetensors.torch import load_file, save

from eaglepipe.core.errors import PipelineError
from eaglepipe.core.sealed import is_sealed, seal, seal_metadata, seal_problem
from eaglepipe.regenerate import store
from eaglepipe.validate.stored import check_regenerated


def sealed_file(path: Path) -> Path:
    tensors = {"w": torch.arange(64, dtype=torch.float32), "d2t": torch.arange(8)}
    path.write_bytes(seal(save(tensors, metadata=seal_metadata({"note": "x"}))))
    return path


def test_a_sealed_file_loads_as_a_plain_one_and_names_any_changed_byte(tmp_path):
    path = sealed_file(tmp_path / "model.safetensors")
    assert torch.equal(load_file(path)["w"], torch.arange(64, dtype=torch.float32))
    assert is_sealed(path) and seal_problem(path) is None
    intact = path.read_bytes()
    flipped = bytearray(intact)
    flipped[-10] ^= 0x01
    path.write_bytes(bytes(flipped))
    assert "re-hashes to xxh3-128" in seal_problem(path)
    path.write_bytes(intact[:-100])
    assert "re-hashes to xxh3-128" in seal_problem(path)
    path.write_bytes(intact[:30])
    assert "is not a readable safetensors file" in seal_problem(path)
    path.unlink()
    assert seal_problem(path).endswith("is missing")
    # A file written before files were sealed: nothing to check it against, not damage.
    path.write_bytes(save({"w": torch.zeros(4)}))
    assert seal_problem(path) is None and not is_sealed(path)


SHARD = "rows_0-4"


def regenerated_shard(root: Path) -> Path:
    """A finished regenerated shard as the job writes it: journal, rows file, manifest."""
    shard_dir = root / "regenerated" / SHARD
    shard_dir.mkdir(parents=True)
    records = [
        {"row_id": i, "messages": [{"role": "user", "content": f"q{i}"}], "output_tokens": i}
        for i in range(4)
    ]
    for record in reversed(records):  # finished out of order, as concurrent rows do
        store.append_row(shard_dir, "key", record)
    size, checksum = store.write_rows(shard_dir, records)
    manifest = {
        "shard": SHARD,
        "row_start": 0,
        "row_end": 4,
        "rows_file": store.ROWS_NAME,
        "bytes": size,
        "xxh3_128": checksum,
        "provenance": {"workflow": "w"},
    }
    store.write_manifest(shard_dir, manifest)
    return shard_dir


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_regenerated_rows_are_restored_from_the_journal(tmp_path, monkeypatch, damage):
    monkeypatch.chdir(tmp_path)
    shard_dir = regenerated_shard(tmp_path)
    rows = shard_dir / store.ROWS_NAME
    intact = rows.read_bytes()
    assert check_regenerated([SHARD]).damaged == []
    if damage == "truncate":
        rows.write_bytes(intact[:-20])
    elif damage == "flip":
        rows.write_bytes(intact.replace(b"q2", b"q3"))
    else:
        rows.unlink()
    (found,) = check_regenerated([SHARD]).damaged
    assert f"regenerated/{SHARD}/rows.jsonl" in found.problem
    assert found.repair() == (
        f"regenerated/{SHARD}/rows.jsonl: restored from its journal (the bytes its manifest lists)"
    )
    assert rows.read_bytes() == intact
    assert (shard_dir / store.MANIFEST_NAME).exists()
    assert check_regenerated([SHARD]).damaged == []


def test_rows_the_journal_cannot_restore_set_the_shard_aside(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shard_dir = regenerated_shard(tmp_path)
    lines = (shard_dir / store.JOURNAL_NAME).read_text().splitlines(keepends=True)
    (shard_dir / store.JOURNAL_NAME).write_text("".join(lines[1:]))  # row 3 lost
    (shard_dir / store.ROWS_NAME).write_bytes(b"{}\n")
    (found,) = check_regenerated([SHARD]).damaged
    assert "is 3 bytes, its manifest lists" in found.problem
    repair = found.repair()
    assert "the journal cannot restore it: manifest set aside as " in repair
    assert "; `snakemake --cores N` regenerates the shard" in repair
    assert not (shard_dir / store.MANIFEST_NAME).exists()
    aside = json.loads((shard_dir / store.INVALID_MANIFEST_NAME).read_text())
    assert aside["reason"] == found.problem and aside["manifest"]["shard"] == SHARD
    # prepare's reader names the damage and the command that repairs it.
    store.write_manifest(shard_dir, aside["manifest"])
    with pytest.raises(PipelineError, match="run `eaglepipe verify`, which restores it"):
        list(store.iter_regenerated_rows(shard_dir / store.MANIFEST_NAME))


def test_verify_refuses_to_pass_what_it_never_looked_at(tmp_path, monkeypatch, capsys):
    """No config and no shard here, a named config that does not load, a named shard root that
    is not there: each is an error (exit 1), never `0 problem(s)`."""
    from eaglepipe.ops.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["verify"]) == 1
    assert capsys.readouterr().err.startswith(
        "error: nothing to verify: no config here (config file config.yaml does not exist) and "
        "no shard directory under hidden_states/"
    )
    typo = tmp_path / "typo.yaml"
    shipped = (REPO_ROOT / "config.yaml").read_text()
    typo.write_text(shipped.replace("rows_per_shard:", "rows_per_shrd:"))
    assert main(["verify", "--config", str(typo)]) == 1
    assert "rows_per_shrd" in capsys.readouterr().err
    assert main(["verify", "--hidden-states", str(tmp_path / "absent")]) == 1
    assert capsys.readouterr().err == (
        f"error: --hidden-states {tmp_path / 'absent'} is not a directory: nothing to verify\n"
    )
    # Copied shards without their run are still checked, every directory of them.
    (tmp_path / "hidden_states" / "rows_0-4").mkdir(parents=True)
    assert main(["verify"]) == 1
    captured = capsys.readouterr()
    assert "note: no shard plan" in captured.err
    assert "error: shard rows_0-4: no manifest.json (extraction not finished)" in captured.out


def test_a_damaged_drafter_file_stops_its_reader_in_one_line_naming_the_repair(tmp_path):
    """The vocabulary, the model and an export were read as they were: a flipped byte trained,
    evaluated, exported (sealed afresh) and served from damaged weights, a truncated one ended
    in safetensors' traceback."""
    from eaglepipe.core.fingerprint import hash_file
    from eaglepipe.core.sealed import CONFIG_SEAL_KEY
    from eaglepipe.drafter.live_run import ExportInfo
    from eaglepipe.drafter.model import load_drafter
    from eaglepipe.drafter.vocab import load_vocab

    repair = ": repair: `eaglepipe verify` sets it aside, then `snakemake --cores N` makes it again"
    for load in (load_vocab, load_drafter):
        path = sealed_file(tmp_path / f"{load.__name__}.safetensors")
        flipped = bytearray(path.read_bytes())
        flipped[-3] ^= 0x40
        path.write_bytes(bytes(flipped))
        with pytest.raises(PipelineError) as raised:
            load(path)
        assert str(raised.value).startswith(f"{path} re-hashes to xxh3-128 ")
        assert str(raised.value).endswith(repair)
        path.write_bytes(bytes(flipped)[:40])
        with pytest.raises(PipelineError, match=r"is not a readable safetensors file .*: repair"):
            load(path)

    export = tmp_path / "export" / "sglang"
    export.mkdir(parents=True)
    config = {"eaglepipe": {"engine": "sglang"}, "eagle_config": {}}
    (export / "config.json").write_text(json.dumps(config))
    tensors = {"w": torch.arange(8, dtype=torch.float32)}
    metadata = seal_metadata({CONFIG_SEAL_KEY: hash_file(export / "config.json")})
    (export / "model.safetensors").write_bytes(seal(save(tensors, metadata=metadata)))
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]  # edited by hand
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(PipelineError) as raised:
        ExportInfo.read(export)
    assert str(raised.value).startswith(f"{export / 'config.json'} re-hashes to xxh3-128 ")
    assert str(raised.value).endswith(repair)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ('{"model": ', "is not valid JSON: "),
        ("[]", "must hold a JSON object"),
        ('{"model": {"bogus": 1}}', ": config key "),
    ],
)
def test_a_damaged_resolved_config_is_named_by_status_and_verify(
    tmp_path, monkeypatch, capsys, content, why
):
    """status ended in a JSONDecodeError traceback; verify checked the shards without a plan,
    skipped every other stage and passed (exit 0)."""
    from eaglepipe.ops.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / ".eaglepipe").mkdir()
    (tmp_path / ".eaglepipe" / "config.json").write_text(content)
    (tmp_path / "hidden_states" / "rows_0-4").mkdir(parents=True)
    for command in ("status", "verify"):
        assert main([command]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: resolved config .eaglepipe/config.json"), err
        assert why in err
        assert err.endswith(
            ": delete .eaglepipe/config.json (config.yaml is then used) or rerun snakemake, "
            "which writes it again\n"
        )


def test_a_torn_offline_evaluation_stops_live_acceptance_in_one_line(tmp_path):
    from eaglepipe.drafter.live import walked_turns

    path = tmp_path / "eval.json"
    path.write_text('{"acceptance_length": 2.1, ')
    with pytest.raises(PipelineError, match=r"^offline evaluation .*eval.json is not valid JSON"):
        walked_turns(path)
