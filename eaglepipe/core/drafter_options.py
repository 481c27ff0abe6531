"""The `train.drafter` options, resolved with the run description: the draft layer (`llama` or
`mla`), the four norm flags, the MLA dimensions; options that contradict each other are refused.
Which engine loads which option is `drafter/variants.py`'s. Free of torch: the Snakefile resolves
the run at parse time."""

from __future__ import annotations

from .errors import PipelineError

LAYERS = ("llama", "mla")
NORM_FLAGS = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")
# The MLA layer's dimensions; each defaults to the target's own value.
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def default_options() -> dict:
    return {"layer": "llama", **{flag: False for flag in NORM_FLAGS}, "mla": {}}


def drafter_options(given: dict | None) -> dict:
    """`train.drafter` (a dict, or DrafterSettings.as_dict()) with every default filled in and
    the MLA dimensions left unset dropped; options that contradict each other are refused."""
    given = given or {}
    options = {**default_options(), **given}
    options["mla"] = {k: v for k, v in (given.get("mla") or {}).items() if v is not None}
    if options["fc_norm"] and options["norm_before_fc"]:
        raise PipelineError(
            "train.drafter: fc_norm and norm_before_fc exclude each other (a norm per aux "
            "layer, or one over all three); set one"
        )
    if options["mla"] and options["layer"] != "mla":
        raise PipelineError(
            f"train.drafter.mla is set but train.drafter.layer is {options['layer']}: "
            "the MLA dimensions apply to layer: mla only"
        )
    return options
