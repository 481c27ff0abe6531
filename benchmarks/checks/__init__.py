"""Pass/fail checks on a real server or converter: fidelity, the MLA shapes served, the whole
pipeline through SGLang, speculators' converter."""
