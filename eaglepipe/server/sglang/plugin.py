"""The project's SGLang general plugin: switches the aux-hidden-state capture on where SGLang has
no capture-only flags, and (on a staged machine only) steers around flashinfer's JIT kernels.

SGLang loads general plugins from the entry-point group `sglang.srt.plugins` (pyproject.toml
registers `eaglepipe = eaglepipe.server.sglang.plugin:register`) at the start of the launcher
and of every scheduler process, then applies the hooks they registered with its own
`HookRegistry`. `register` does nothing unless the launcher or the machine's staging asked for
it, so an SGLang started by anything else in the same environment is untouched:

- CAPTURE_ENV (set by eaglepipe/server/sglang/recipe.py for releases without capture-only
  flags): a JSON list of SGLang capture ids. Right after a model runner loads its model, the
  target's runner (not a speculative draft's, and only without a speculative algorithm: a real
  EAGLE-3 draft sets the capture from its own config) calls
  `model.set_eagle3_layers_to_capture(ids)`: what capture-only mode does in the releases that
  have it, before any forward, CUDA-graph capture or forward-hook registration.
- SLIM_FLASHINFER_ENV=1 (set by tools/h200.sh when the staged flashinfer wheel has no JIT
  sources, flashinfer/data/): sgl_kernel's norm and sampling use their own precompiled kernels
  instead of flashinfer's JIT, and DeepSeek's grouped top-k uses sgl_kernel's `moe_fused_gate`
  instead of flashinfer's `fused_topk_deepseek`. A full flashinfer install never sets it.

SGLang logs and swallows a plugin's exceptions; a capture that was not switched on surfaces in
the dump hook, which refuses a prefixed request that arrives without aux hidden states.
"""

from __future__ import annotations

import functools
import json
import os
import sys

CAPTURE_ENV = "EAGLEPIPE_SGLANG_CAPTURE_LAYER_IDS"
SLIM_FLASHINFER_ENV = "EAGLEPIPE_SGLANG_SLIM_FLASHINFER"
# The model runner's model loading: present, with this name, across the supported range.
LOAD_MODEL = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"


def _say(message: str) -> None:
    print(f"[eaglepipe sglang plugin] {message}", file=sys.stderr, flush=True)


def capture_layer_ids(environ=None) -> list[int] | None:
    """The capture ids the launcher passed, or None when the capture is not ours to switch on."""
    raw = (os.environ if environ is None else environ).get(CAPTURE_ENV, "")
    if not raw.strip():
        return None
    ids = json.loads(raw)
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{CAPTURE_ENV}={raw!r}: expected a JSON list of layer ids")
    return ids


def register() -> None:
    """SGLang's plugin entry point: registers an AFTER hook on the model runner's load_model."""
    ids = capture_layer_ids()
    slim = os.environ.get(SLIM_FLASHINFER_ENV) == "1"
    if ids is None and not slim:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hook = functools.partial(after_load_model, capture_ids=ids, slim_flashinfer=slim)
    HookRegistry.register(LOAD_MODEL, hook, HookType.AFTER)


def after_load_model(result, runner, *args, capture_ids, slim_flashinfer, **kwargs) -> None:
    """Runs in the scheduler process once `runner` has its model (SGLang's AFTER hook)."""
    if slim_flashinfer:
        use_precompiled_kernels()
    if capture_ids is not None:
        switch_capture_on(runner, capture_ids)
    return None  # keep load_model's own result


def switch_capture_on(runner, capture_ids: list[int]) -> bool:
    """Capture `capture_ids` on the target model; a draft runner, or a target that serves
    with a speculative algorithm, is left alone. Returns whether the capture was switched on."""
    model = runner.model
    name = type(model).__name__
    if runner.is_draft_worker:
        _say(f"{name}: a speculative draft model's runner, capture left alone")
        return False
    if not runner.spec_algorithm.is_none():
        _say(f"{name}: serves with a speculative algorithm, whose draft sets the capture")
        return False
    model.set_eagle3_layers_to_capture(list(capture_ids))
    language_model = getattr(model, "language_model", None) or model
    captured = getattr(getattr(language_model, "model", None), "layers_to_capture", None)
    _say(f"{name}.set_eagle3_layers_to_capture({capture_ids}): layers_to_capture = {captured}")
    return True


def use_precompiled_kernels() -> None:
    """sgl_kernel's own kernels where SGLang would otherwise JIT-build flashinfer's."""
    import sgl_kernel.elementwise
    import sgl_kernel.sampling
    import sglang.srt.layers.moe.topk as topk

    sgl_kernel.elementwise._has_flashinfer = False
    sgl_kernel.sampling._has_flashinfer = False
    topk.fused_topk_deepseek = None
    _say("flashinfer has no JIT sources here: sgl_kernel's precompiled norm, sampling and top-k")
