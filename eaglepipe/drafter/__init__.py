"""The EAGLE-3 drafter: vocabulary, model, training, evaluation, export and live check."""
