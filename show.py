"""See what the teacher knows: episodes token by token, as one self-contained HTML page (paper §3.3, eqs. 9-12).

    python eval.py --run runs/toy --show 5        # runs/toy/show.html: 5 held-out episodes of the trained student

The method's idea sits on a few tokens: where the teacher behind its latents disagrees with the student. The page
shows each held-out episode of the student in order. Every token the student sampled (ω = 1) is coloured by its
term of eq. (10), the reverse KL(p̃S ‖ p̃T) over the teacher's top-M ids and the tail; hovering over it (a title
attribute: no script) gives δ of eq. (11), the sampled token's probability under student and teacher, and the
teacher's five likeliest alternatives. Observations (ω = 0) are grey. Above each episode: its reward, A = 2r − 1,
its share of Δ (eq. 12), and the J references the retriever gave the teacher. A second section scores the same
episodes under the teacher behind same-shop references and behind other-shop references and colours each token by
the difference of its log-probability: the world check, token by token.

The numbers are the training path's: `lopd.student_teacher_logits` for the scores and `losses.token_terms` for
eqs. (9)-(11), the function `losses.lopd_objective` itself calls; tests/test_show.py checks that the page's KL
terms add up to the `loss/distill` that training logs for the same batch. The page holds no script, no external
resource, and escapes every token and observation (a token may be `<script>`).
"""
from __future__ import annotations

import html

import torch

import engine
import losses
import lopd

# Long observations (a tool's answer, a program's output) are cut in the middle so a page of a 4,000-token episode
# stays readable: the first and last characters of a longer grey run are kept.
OBSERVATION_CHARS = 400


@torch.no_grad()
def episode_terms(student, composer, chat, eps, latents, top_m: int = losses.TOP_M) -> list[dict]:
    """Per episode, per continuation token: its id, ω, and (on ω tokens) the KL term of eq. (10), δ of eq. (11),
    p_S(a), p_T(a) and the teacher's top-5 ids with their probabilities. chat: the run's engine.Chat; latents
    (B, J·K, d)."""
    ls, lt, ids, omega = lopd.student_teacher_logits(student, composer, chat, eps, latents)   # (B, Tc, V), (B, Tc)
    sel = omega.bool()                                                          # (B, Tc)
    logp_s, logp_t = losses.supervised_logprobs(ls, sel), losses.supervised_logprobs(lt, sel)   # (N, V) each
    kl, lt_a, ls_a = losses.token_terms(logp_s, logp_t, ids[sel].unsqueeze(-1), top_m)          # (N,) each
    delta = losses.privilege_delta(lt_a, ls_a)                                  # (N,) eq. (11)
    top_p, top_i = logp_t.exp().topk(5, dim=-1)                                 # (N, 5)
    kl, delta, p_s, p_t = (x.tolist() for x in (kl, delta, ls_a.exp(), lt_a.exp()))
    top_p, top_i, sel = top_p.tolist(), top_i.tolist(), sel.tolist()
    rows, k = [], 0
    for b, ep in enumerate(eps):
        toks = []
        for t in range(len(ep.ids) - ep.prompt_len):
            tid = ep.ids[ep.prompt_len + t]                                    # the sampled id, as scored
            if not sel[b][t]:
                toks.append({"id": tid, "omega": 0})
                continue
            toks.append({"id": tid, "omega": 1, "kl": kl[k], "delta": delta[k], "p_s": p_s[k], "p_t": p_t[k],
                         "alts": list(zip(top_i[k], top_p[k]))})
            k += 1
        rows.append({"tokens": toks})
    return rows


@torch.no_grad()
def teacher_logprobs(composer, chat, eps, latents):
    """log p_T(a_t) of each episode's own sampled tokens behind `latents` (B, J·K, d): (B, Tc), 0 on observations."""
    lp = lopd.teacher_logits(composer, chat, eps, latents).float().log_softmax(-1)                 # (B, Tc, V)
    conts, omega = engine.continuation(eps, latents.device)                                           # ω (B, Tc)
    ids = torch.zeros(omega.shape, dtype=torch.long, device=latents.device)                        # (B, Tc)
    for b, c in enumerate(conts):
        ids[b, :len(c)] = torch.tensor(c, device=latents.device)
    return lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1) * omega                                     # (B, Tc)


def teacher_shift_terms(composer, chat, eps, lat_same, lat_other) -> list[list[float]]:
    """Per episode, per continuation token: log p_T(a) behind same-shop latents minus behind other-shop latents
    (0 on observations). lat_* (B, J·K, d)."""
    move = teacher_logprobs(composer, chat, eps, lat_same) - teacher_logprobs(composer, chat, eps, lat_other)  # (B, Tc)
    return [move[b, :len(ep.ids) - ep.prompt_len].tolist() for b, ep in enumerate(eps)]


def _colour(value: float, scale: float, negative: bool = False) -> str:
    """White for 0, red at `scale` (blue below 0 where `negative`): a CSS background."""
    x = max(-1.0, min(1.0, value / scale)) if scale > 0 else 0.0
    if x < 0 and negative:
        return f"rgb({int(255 * (1 + x))},{int(255 * (1 + x))},255)"
    x = max(0.0, x)
    return f"rgb(255,{int(255 * (1 - x))},{int(255 * (1 - x))})"


def _token_text(tok, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False)


def _grey(text: str) -> str:
    if len(text) > OBSERVATION_CHARS:
        half = OBSERVATION_CHARS // 2
        text = text[:half] + f" … [{len(text) - OBSERVATION_CHARS} characters] … " + text[-half:]
    return f'<span class="obs">{html.escape(text, quote=True)}</span>'


def episode_html(tok, ep, terms: dict, refs: list[str], shift: list[float] | None = None,
                 n_traj: int = 1, scale: float | None = None) -> str:
    """One episode as HTML: a header (task, reward, A, its share of Δ, references), then its tokens. scale: the KL
    that is full red (default: this episode's largest; a page passes its own largest, so colours compare)."""
    omega_terms = [x for x in terms["tokens"] if x["omega"]]
    A = 2 * ep.reward - 1
    mean_delta = sum(x["delta"] for x in omega_terms) / max(1, len(omega_terms))
    largest = max([x["kl"] for x in omega_terms] + [1e-6])
    scale = scale or largest
    head = (f'<h3>{html.escape(ep.task.task_id)}: {html.escape(ep.task.text)}</h3>'
            f'<p class="meta">reward {ep.reward:.2f} · A = 2r − 1 = {A:+.2f} · share of Δ (eq. 12) A·mean δ / '
            f'{n_traj} = {A * mean_delta / n_traj:+.4f} · reply tokens {len(omega_terms)} · largest KL term '
            f'{largest:.4f} nats</p><ol class="refs">' +
            "".join(f"<li>{html.escape(r)}</li>" for r in refs) + "</ol>")
    spans, grey = [], []
    for t, x in enumerate(terms["tokens"]):
        text = _token_text(tok, x["id"])
        if not x["omega"]:
            grey.append(text)
            continue
        if grey:
            spans.append(_grey("".join(grey)))
            grey = []
        alts = ", ".join(f"{_token_text(tok, i)!r} {p:.2f}" for i, p in x["alts"])
        tip = (f"KL {x['kl']:.4f} · δ {x['delta']:+.3f} · p_S {x['p_s']:.3f} · p_T {x['p_t']:.3f} · "
               f"teacher's top 5: {alts}")
        if shift is not None:
            tip += f" · same − other variant {shift[t]:+.2f} nats"
            bg = _colour(shift[t], 3.0, negative=True)
        else:
            bg = _colour(x["kl"], scale)
        spans.append(f'<span class="tok" style="background:{bg}" title="{html.escape(tip, quote=True)}">'
                     f'{html.escape(text, quote=True)}</span>')
    if grey:
        spans.append(_grey("".join(grey)))
    return f'<section class="ep">{head}<pre>{"".join(spans)}</pre></section>'


STYLE = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}
pre{white-space:pre-wrap;font:13px/1.5 monospace;border:1px solid #ddd;padding:8px}
.obs{color:#999}.tok{border-radius:2px}.meta{color:#555;font-size:13px}.refs{font-size:12px;color:#555}
.key span{padding:0 6px}"""


def page(title: str, sections: list[tuple[str, str, list[str]]]) -> str:
    """The whole page: sections of (heading, explanation, episodes' HTML)."""
    body = "".join(f"<h2>{html.escape(h)}</h2><p>{html.escape(p)}</p>{''.join(eps)}" for h, p, eps in sections)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>")


def largest_kl(terms: list[dict]) -> float:
    """The largest KL term of a page's episodes: the colour scale they share."""
    return max([x["kl"] for t in terms for x in t["tokens"] if x["omega"]] + [1e-6])


def reference_lines(experiences) -> list[list[str]]:
    """The task line of each retrieved reference (what the teacher's latents were composed from)."""
    return [[(e.get("task") or "(no reference)").splitlines()[0][:160] for e in es] for es in experiences]
