"""The worlds and benchmarks, behind one interface (common.py), one file each; the engine and the methods know none.

    common.py           Environment (reset / step / reward), StepResult, the --env loader, the tool-call parsers
    tool_world.py       the toy tool-use world: shops with hidden conventions (the default run)
    code_world.py       single-turn programs: CodeWorld, and the toy code world with its judges
    code_benchmarks.py  TACO, LiveCodeBench, HumanEval+ and MBPP+ as released, each by its harness's rules
    bfcl.py             BFCL-v3 multi-turn and single-turn, scored by BFCL's own checkers
    envscaler.py        EnvScaler's released environments and scenarios
    acebench.py         ACEBench's English agent tasks (multi-step, multi-turn) from a clone, scored by its checker
    sandbox.py          the kernel's confinement of the code these worlds run
    results.py          the tables a world's results are written in, the paper's values beside them
    toy_backbone.py     the offline toy backbone pretrained on the toy worlds' demonstrations
"""
