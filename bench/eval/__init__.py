"""Quality evaluation of the attention methods through the model runtime (the paper's Experiments section).

Scripts, each run as ``python -m bench.eval.<name> --help`` from the repository root:
perplexity, niah, fidelity, sweep (sensitivity + ablation), long_horizon, longbench, and suite (the
default suite on the embedded model, one command). ``common`` holds what they share.
"""
