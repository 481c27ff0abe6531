"""The drafters a benchmark measures: our export, and any EAGLE-3 draft directory another tool
wrote in SGLang's layout (SpecForge's `export --to sglang`: config.json + model.safetensors, no
`eaglepipe` block), served the same way on the same prompts and settings.

A draft directory is read as SGLang reads it: its architecture must be an EAGLE-3 draft class
SGLang has, its aux layer ids are `eagle_config.eagle_aux_hidden_state_layer_ids` (absent:
SGLang captures its default layers, the outputs of our `[1, L//2-1, L-4]`), its weights
`model.safetensors`. Nothing in the directory is changed. (No torch at import: the Snakefile
checks draft directories when it is parsed.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import PipelineError
from ..core.layers import resolve_aux_layer_ids
from ..core.run import RunSpec
from ..drafter.live_run import ExportInfo
from ..drafter.variants import ARCHITECTURES

OURS = "eaglepipe"


@dataclass(frozen=True)
class Drafter:
    """One drafter as the harness serves it."""

    name: str
    export: ExportInfo
    captured: list[int]  # our layer ids the engine captures for it
    trained_by: str  # eaglepipe, or external
    layer_ids_from: str  # where the written ids came from

    def record(self) -> dict:
        return {
            "name": self.name,
            "directory": str(self.export.directory),
            "trained_by": self.trained_by,
            "aux_layer_ids_written": self.export.written_layer_ids,
            "aux_layer_ids_from": self.layer_ids_from,
            "aux_layers_captured": self.captured,
        }


def check_draft_dir(name: str, directory: str | Path) -> dict:
    """The config.json of a draft directory another tool wrote, or one error naming the
    drafter, the file and what is wrong."""
    directory = Path(directory)
    key = f"config key benchmarks.drafters.{name}"
    config_path, weights = directory / "config.json", directory / "model.safetensors"
    if not config_path.is_file():
        raise PipelineError(
            f"{key}: {config_path} does not exist (an EAGLE-3 draft directory in SGLang's "
            "layout holds config.json and model.safetensors)"
        )
    if not weights.is_file():
        found = sorted(p.name for p in directory.glob("*.safetensors")) or ["none"]
        raise PipelineError(
            f"{key}: {weights} does not exist (safetensors files there: {', '.join(found)}); "
            "the draft's weights must be one model.safetensors"
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise PipelineError(f"{key}: {config_path} is not readable JSON ({exc})") from None
    arch = (config.get("architectures") or [None])[0] if isinstance(config, dict) else None
    if arch not in ARCHITECTURES.values():
        raise PipelineError(
            f"{key}: {config_path} names architecture {arch!r}, not an EAGLE-3 draft class "
            f"SGLang serves ({', '.join(sorted(ARCHITECTURES.values()))})"
        )
    return config


def external_drafter(run: RunSpec, name: str, directory: str | Path) -> Drafter:
    """A draft directory another tool wrote, as SGLang would serve it for this target."""
    from ..drafter.export import engine_captured_layers, engine_layer_ids, target_family

    config = check_draft_dir(name, directory)
    family = target_family(run.model.config)
    written = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    source = "eagle_config.eagle_aux_hidden_state_layer_ids"
    if not written:
        default = resolve_aux_layer_ids(None, run.model.num_layers)
        written, source = engine_layer_ids("sglang", family, default), "SGLang's default"
    written = [int(i) for i in written]
    export = ExportInfo(Path(directory), "sglang", written, config)
    captured = engine_captured_layers("sglang", family, written)
    return Drafter(name, export, captured, "external", source)


def our_drafter(run: RunSpec, export_dir: str | Path) -> Drafter:
    from ..drafter.export import engine_captured_layers, target_family

    export = ExportInfo.read(export_dir)
    captured = engine_captured_layers(
        export.engine, target_family(run.model.config), export.written_layer_ids
    )
    return Drafter(OURS, export, captured, OURS, f"{export_dir}/config.json")
