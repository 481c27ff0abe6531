"""A stand-in for `python -m sglang.launch_server` in the live-acceptance tests.

It takes the flags the live-acceptance launcher passes (argparse, like SGLang's own parser: an
unknown flag is an error, except the extra args the test config adds), answers `/health`,
`/server_info` and a greedy `/generate` in SGLang's JSON shape (meta_info with
`completion_tokens` and, when drafting, `spec_verify_ct`, `spec_num_correct_drafts` and
`spec_accept_length` computed as SGLang 0.5.14's tokenizer_manager computes them), and runs the
project's transformers harness as its engine: the target, and the EAGLE-3 draft read from
`--speculative-draft-model-path`. Test switches (environment): FAKE_SGLANG_FAIL makes it exit
at startup; FAKE_SGLANG_CHILD_PID_FILE makes it start a child process (SGLang's schedulers are
children in the server's group) and write the child's pid there.
"""

import argparse
import json
import os
import subprocess
import sys

from aiohttp import web

TEST_EXTRA_FLAGS = ("--attention-backend", "--sampling-backend", "--grammar-backend")


def parse(argv):
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--dtype")
    parser.add_argument("--speculative-algorithm")
    parser.add_argument("--speculative-draft-model-path")
    parser.add_argument("--speculative-num-steps", type=int)
    parser.add_argument("--speculative-eagle-topk", type=int)
    parser.add_argument("--speculative-num-draft-tokens", type=int)
    for flag in TEST_EXTRA_FLAGS:
        parser.add_argument(flag)
    return parser.parse_args(argv)


def main():
    args = parse(sys.argv[1:])
    print(f"fake sglang: {json.dumps(vars(args))}", flush=True)
    if os.environ.get("FAKE_SGLANG_FAIL"):
        print("fake sglang: RuntimeError: CUDA out of memory (FAKE_SGLANG_FAIL)", flush=True)
        sys.exit(3)
    child_file = os.environ.get("FAKE_SGLANG_CHILD_PID_FILE")
    if child_file:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(child_file, "w") as f:
            f.write(str(child.pid))

    import torch

    from eaglepipe.core.layers import default_aux_layer_ids
    from eaglepipe.drafter.export import engine_captured_layers, target_family
    from eaglepipe.drafter.live_run import ExportInfo
    from eaglepipe.drafter.live_transformers import (
        Target,
        load_exported_drafter,
        speculative_decode,
    )

    drafting = args.speculative_algorithm == "EAGLE3"
    captured = [1, 3, 4]
    if drafting:
        assert args.speculative_eagle_topk == 1
        assert args.speculative_num_draft_tokens == args.speculative_num_steps + 1
        draft_dir = args.speculative_draft_model_path
        with open(os.path.join(draft_dir, "config.json")) as f:
            draft_config = json.load(f)
        with open(os.path.join(args.model_path, "config.json")) as f:
            target_config = json.load(f)
        family = target_family(target_config)
        if "eaglepipe" in draft_config:
            export = ExportInfo.read(draft_dir)
        else:  # another tool's draft directory, as SGLang reads it
            eagle = draft_config.get("eagle_config") or {}
            written = eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_layer_ids(
                target_config["num_hidden_layers"]
            )  # SGLang's default capture: the outputs of our default layers
            export = ExportInfo(draft_dir, "sglang", written, draft_config)
        captured = engine_captured_layers("sglang", family, export.written_layer_ids)
    target = Target(args.model_path, captured, torch.device("cpu"))
    drafter = None
    if drafting:
        drafter = load_exported_drafter(export)
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight.float())
        drafter.eval()

    async def health(request):
        return web.Response(text="")

    async def server_info(request):
        return web.json_response({"version": "0.5.14-fake", "model_path": args.model_path})

    async def generate(request):
        body = await request.json()
        params = body.get("sampling_params") or {}
        if params.get("temperature") != 0.0:
            return web.json_response({"error": {"message": f"not greedy: {params}"}}, status=400)
        prompt, n = body["input_ids"], int(params["max_new_tokens"])
        stops = set(params.get("stop_token_ids") or ())
        if params.get("ignore_eos"):
            stops = set()
        if drafter is None:
            output = target.greedy(prompt, n, stops)
        else:
            output, rounds = speculative_decode(
                target, drafter, prompt, n, args.speculative_num_steps, stops
            )
        stopped = bool(output) and output[-1] in stops
        meta = {
            "id": "fake",
            "finish_reason": (
                {"type": "stop", "matched": output[-1]}
                if stopped
                else {"type": "length", "length": n}
            ),
            "prompt_tokens": len(prompt),
            "completion_tokens": len(output),
            "cached_tokens": 0,
        }
        if drafter is not None:
            correct = sum(rounds)
            meta.update(
                spec_accept_rate=correct / max(1, len(rounds) * args.speculative_num_steps),
                spec_accept_length=len(output) / len(rounds) if rounds else float(len(output)),
                spec_num_correct_drafts=correct,
                spec_num_proposed_drafts=len(rounds) * args.speculative_num_steps,
                spec_verify_ct=len(rounds),
            )
        if body.get("return_logprob"):
            # [[logprob, token id, text], ...] per output position, top_logprobs_num of them
            top = []
            for i in range(len(output)):
                logits = target.model(torch.tensor([prompt + output[:i]])).logits[0, -1]
                values, ids = torch.log_softmax(logits.float(), -1).topk(
                    int(body.get("top_logprobs_num") or 1)
                )
                top.append([[float(v), int(j), None] for v, j in zip(values, ids, strict=True)])
            meta["output_top_logprobs"] = top
        return web.json_response({"text": "", "output_ids": output, "meta_info": meta})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
    app.router.add_post("/generate", generate)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
