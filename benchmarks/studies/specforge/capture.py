#!/usr/bin/env python3
"""Run SpecForge's own feature generator, scripts/prepare_hidden_states.py (its target in
SGLang's model runner, in-process), on the staged H200 machine (issue 27).

    python3 -m torch.distributed.run --standalone --nproc_per_node 1 \\
        benchmarks/studies/specforge/capture.py --template-json toy.json \\
        --script .whl-specforge/prepare_hidden_states.py -- [the script's own arguments]

Two things SpecForge's script cannot do by itself there, done before it runs:

- register the target's chat template (the JSON compare.py writes) in SpecForge's
  template registry, so `--chat-template <its name>` finds it: the toy target's template is not
  one SpecForge ships;
- with EAGLEPIPE_SGLANG_SLIM_FLASHINFER=1 (tools/h200.sh sets it: the staged flashinfer has no
  JIT sources), route sgl_kernel's norm, sampling and top-k to its precompiled kernels, as the
  project's SGLang plugin does in a server. SGLang's plugin loader, where that plugin runs,
  belongs to the server's launcher, which SpecForge's in-process model runner never starts.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--template-json", required=True)
    parser.add_argument("--script", required=True, help="SpecForge's prepare_hidden_states.py")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the script's arguments")
    args = parser.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    from benchmarks.studies.specforge.hf_features import register_template

    name = register_template(args.template_json)
    print(f"[specforge_capture] chat template {name!r} registered", file=sys.stderr, flush=True)
    if os.environ.get("EAGLEPIPE_SGLANG_SLIM_FLASHINFER") == "1":
        from eaglepipe.server.sglang.plugin import use_precompiled_kernels

        use_precompiled_kernels()
    script = str(Path(args.script).resolve())
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
