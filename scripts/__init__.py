"""The entry points beside train.py and eval.py, each run from the repository's root as a module:

    python -m scripts.experiments ablations     # experiments.py: the ablation table, Figure 4, the dial, ...
    python -m scripts.bench --memory            # bench.py: step and loss costs, memory, engines, the verifier
"""
