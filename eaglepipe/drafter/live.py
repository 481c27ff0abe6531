"""Live speculative decoding against the target: the check a layer-id or export bug fails.

The drafter is read from the *exported* SGLang directory through the same name mapping
SGLang applies (export.load_like_sglang), and the target's aux layers are the ones SGLang
would capture given the exported ids and the target's family. Then, per held-out prompt
(the tokens before its first loss-masked token), greedy chain drafting:

    committed tokens S (n of them), pending token x (the target's greedy next token)
    draft: step 0 over S with inputs S[1:] + [x] and fc(aux of S); its last position gives d1;
           step j feeds d_j at that position (exactly the training-time-test layout)
    verify: one target forward over S + [x, d1..dk]; accept the longest prefix of d equal to
            the target's greedy tokens; the target's token after it becomes the next pending.

Each round yields accepted + 1 tokens; the mean over rounds is the acceptance length. The
output is also compared with plain greedy decoding of the target (it must be identical).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..atomic import atomic_write_json
from ..config import model_dir, read_model_config
from ..errors import PipelineError
from ..prepare import load_prepared
from .export import (
    drafter_from_sglang_params,
    engine_captured_layers,
    load_like_sglang,
    target_family,
)
from .model import Eagle3Drafter


def held_out_prompts(table_path, count: int) -> list[tuple[int, list[int]]]:
    """(row id, prompt ids) of the first `count` eval rows that have an assistant turn."""
    table = load_prepared(table_path, columns=["row_id", "split", "input_ids", "loss_mask"])
    prompts = []
    for row in table[table["split"] == "eval"].sort_values("row_id").itertuples():
        mask = np.asarray(row.loss_mask, dtype=bool)
        if not mask.any():
            continue
        first = int(mask.argmax())
        if first > 0:
            prompts.append((int(row.row_id), [int(t) for t in row.input_ids[:first]]))
        if len(prompts) == count:
            break
    return prompts


class Target:
    """A transformers target exposing greedy logits and the captured aux hidden states."""

    def __init__(self, path, aux_layers: list[int], device: torch.device, trust_remote_code=False):
        from transformers import AutoModelForCausalLM

        # fp32 on CPU (the toy target); bf16 on a GPU, as the engines would serve it.
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code
        ).to(device)
        self.model.eval()
        self.aux_layers = aux_layers
        self.device = device

    @torch.no_grad()
    def forward(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy next token at every position [n], aux hidden states [n, 3H])."""
        out = self.model(
            torch.tensor([ids], device=self.device), output_hidden_states=True, use_cache=False
        )
        # Our aux id k is the output of decoder layer k = hidden_states[k + 1] (layers.py).
        aux = torch.cat([out.hidden_states[k + 1][0] for k in self.aux_layers], dim=-1)
        return out.logits[0].argmax(-1), aux.float()

    @torch.no_grad()
    def greedy(self, ids: list[int], new_tokens: int) -> list[int]:
        ids = list(ids)
        for _ in range(new_tokens):
            next_ids, _ = self.forward(ids)
            ids.append(int(next_ids[-1]))
        return ids


@torch.no_grad()
def draft_chain(
    drafter: Eagle3Drafter, committed: list[int], pending: int, aux: torch.Tensor, k: int
) -> list[int]:
    """k draft tokens continuing committed + [pending], from the aux states of `committed`."""
    device = aux.device
    n = len(committed)
    inputs = torch.tensor([committed[1:] + [pending]], device=device)
    positions = torch.arange(n, device=device)[None]
    hidden = drafter.project(aux[None, :n])
    kv_cache: list = []
    drafted: list[int] = []
    for step in range(k):
        hidden, logits = drafter.step(inputs, hidden, positions + step, kv_cache)
        token = int(drafter.draft_to_target(logits[0, -1].argmax()))
        drafted.append(token)
        inputs = inputs.clone()
        inputs[0, -1] = token
    return drafted


def speculative_decode(
    target: Target, drafter: Eagle3Drafter, prompt: list[int], new_tokens: int, k: int
) -> tuple[list[int], list[int]]:
    """(generated ids, accepted count per round)."""
    committed = list(prompt)
    greedy, aux = target.forward(committed)
    pending = int(greedy[-1])
    produced: list[int] = []
    rounds: list[int] = []
    while len(produced) < new_tokens:
        drafted = draft_chain(drafter, committed, pending, aux, k)
        checked = committed + [pending] + drafted
        greedy, aux_all = target.forward(checked)
        n = len(committed)
        accepted = 0
        while accepted < k and int(greedy[n + accepted]) == drafted[accepted]:
            accepted += 1
        rounds.append(accepted)
        new = [pending] + drafted[:accepted]
        produced.extend(new)
        committed = committed + new
        pending = int(greedy[n + accepted])
        aux = aux_all[: len(committed)]
    return produced[:new_tokens], rounds


def live_acceptance(
    config: dict,
    *,
    export_dir: str,
    table_path: str,
    out_path: str,
    eval_path: str | None = None,
) -> dict:
    ec, tc = config["evaluate"], config["train"]
    if ec["live_prompts"] == 0:
        raise PipelineError("evaluate.live_prompts is 0: no live check to run")
    export_config, params = load_like_sglang(export_dir)
    target_config = read_model_config(config)
    family = target_family(target_config)
    written = export_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    aux_layers = engine_captured_layers("sglang", family, written)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = Target(
        model_dir(config), aux_layers, device, config["model"].get("trust_remote_code", False)
    )
    drafter = drafter_from_sglang_params(export_config, params)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight.float())
    drafter = drafter.to(device).eval()

    prompts = held_out_prompts(table_path, ec["live_prompts"])
    if not prompts:
        raise PipelineError(f"{table_path} has no held-out row with an assistant turn")
    k = tc["ttt_length"]
    all_rounds: list[int] = []
    identical = 0
    per_prompt = []
    for i, (row_id, prompt) in enumerate(prompts, 1):
        produced, rounds = speculative_decode(target, drafter, prompt, ec["live_new_tokens"], k)
        reference = target.greedy(prompt, ec["live_new_tokens"])[len(prompt) :]
        same = produced == reference
        identical += same
        all_rounds.extend(rounds)
        mean = 1.0 + sum(rounds) / len(rounds)
        per_prompt.append(
            {
                "row_id": row_id,
                "rounds": len(rounds),
                "acceptance_length": mean,
                "matches_greedy": same,
            }
        )
        print(
            f"live prompt {i}/{len(prompts)} (row {row_id}): acceptance length {mean:.2f}",
            flush=True,
        )
    offline = None
    if eval_path and Path(eval_path).exists():
        offline = json.loads(Path(eval_path).read_text()).get("acceptance_length")
    result = {
        "export_dir": str(export_dir),
        "target_family": family,
        "aux_layer_ids_written": written,
        "aux_layers_captured": aux_layers,
        "prompts": len(prompts),
        "new_tokens": ec["live_new_tokens"],
        "ttt_length": k,
        "rounds": len(all_rounds),
        "acceptance_length": 1.0 + sum(all_rounds) / len(all_rounds),
        "offline_acceptance_length": offline,
        "outputs_match_greedy": identical,
        "per_prompt": per_prompt,
    }
    atomic_write_json(out_path, result)
    print(
        f"live acceptance length {result['acceptance_length']:.3f} "
        f"(offline estimate {offline}); {identical}/{len(prompts)} outputs equal plain greedy",
        flush=True,
    )
    return result
