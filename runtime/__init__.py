"""Engineering, not the paper: skip this folder on a first read.

Everything a run needs that the method does not, one file a concern; lopd.py, baselines.py, train.py and eval.py
call these helpers through their file's name (`parallel.all_sum`, `memory.fit_memory`, `checkpoints.save_checkpoint`):

    devices.py      user errors (one line, exit status 2), device and precision, one seed, the log, the time left
    parallel.py     data parallel under torchrun; FSDP2 for the student; the identity in one process
    models.py       the student (full fp32 copy or LoRA), PEFT's adapter switches, gradient checkpointing,
                    the LM head bypassed for the chunked losses, a backbone's config and tokenizer
    memory.py       the memory plan, made before any weight is read, and again beside the loaded backbone
    checkpoints.py  atomic files, checkpoints and resume, the evaluation's rows read back after a kill
    serving.py      vLLM as the rollout engine (--engine vllm)
    preflight.py    train.py's and eval.py's command lines checked before torch loads (it imports no torch)

This file imports nothing, so that `from runtime import preflight` loads no torch. With one process and no process
group every data-parallel helper is the identity: the single-process path is exactly the readable code. No
deviation from the paper lives here: the official code's engineering (SGLang rollouts, Ray workers, DeepSpeed) is
replaced, not followed, and the mathematics these helpers serve is the same on any number of processes.
"""
