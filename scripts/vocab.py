#!/usr/bin/env python3
"""Build the draft vocabulary (d2t/t2d) from the loss-masked tokens of the train rows."""

import argparse

from eaglepipe.core.errors import one_line_errors
from eaglepipe.core.run import load_run
from eaglepipe.drafter.vocab import build_draft_vocab, save_vocab
from eaglepipe.prepare.table import load_prepared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--table", required=True, help="prepared/tokenized.parquet")
    parser.add_argument("--out", required=True, help="drafter/vocab.safetensors")
    args = parser.parse_args()
    with one_line_errors():
        run = load_run(args.config)
        vocab_size = int(run.model.text_config["vocab_size"])
        table = load_prepared(args.table, columns=["row_id", "split", "input_ids", "loss_mask"])
        vocab, stats = build_draft_vocab(table, vocab_size, run.train.draft_vocab_size)
        save_vocab(vocab, args.out, stats)
        print(
            f"draft vocabulary: {stats['draft_vocab_size']} of {vocab_size} ids cover "
            f"{stats['coverage']:.1%} of {stats['masked_tokens']} loss-masked train tokens "
            f"-> {args.out}",
            flush=True,
        )


if __name__ == "__main__":
    main()
