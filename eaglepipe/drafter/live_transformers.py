"""Live acceptance in transformers (server.engine reference): target and exported drafter.

The drafter is read from the *exported* directory through the name mapping of the engine it
was exported for (`engine_load.load_exported_drafter`: SGLang's or vLLM's, for either draft
layer), and the target's aux layers are the ones that engine would capture given the exported
ids and the target's family. Then, per prompt, greedy chain drafting:

    committed tokens S (n of them), pending token x (the target's greedy next token)
    draft: step 0 over S with inputs S[1:] + [x] and fc(aux of S); its last position gives d1;
           step j feeds d_j at that position (exactly the training-time-test layout)
    verify: one target forward over S + [x, d1..dk]; accept the longest prefix of d equal to
            the target's greedy tokens; the target's token after it becomes the next pending.

Each round yields accepted + 1 tokens. The output is compared with plain greedy decoding of the
target. The whole target is loaded on one device: this harness is for targets that fit.
"""

from __future__ import annotations

import torch

from ..core.run import RunSpec
from .engine_load import load_exported_drafter
from .live_run import ExportInfo, PromptRun
from .model import Eagle3Drafter


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


def run_transformers(
    run: RunSpec, export: ExportInfo, captured: list[int], prompts: list[tuple[int, list[int]]]
) -> tuple[list[PromptRun], dict]:
    """Every prompt decoded with the drafter and plainly, in transformers on one device."""
    new_tokens, k = run.evaluate.live_new_tokens, run.train.ttt_length
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = Target(run.model.directory, captured, device, run.model.trust_remote_code)
    drafter = load_exported_drafter(export)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight.float())
    drafter = drafter.to(device).eval()
    runs = []
    for i, (row_id, prompt) in enumerate(prompts, 1):
        produced, rounds = speculative_decode(target, drafter, prompt, new_tokens, k)
        greedy = target.greedy(prompt, new_tokens)[len(prompt) :]
        runs.append(PromptRun(row_id, produced, greedy, len(rounds), sum(rounds)))
        print(
            f"live prompt {i}/{len(prompts)} (row {row_id}): acceptance length "
            f"{1 + sum(rounds) / len(rounds):.2f}",
            flush=True,
        )
    return runs, {"device": str(device)}
