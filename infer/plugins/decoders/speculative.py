"""`speculative`: propose k tokens cheaply, verify them with one target forward, keep what the
target would have produced. Lossless: greedy output is token-identical to `autoregressive`, and
sampled output follows the target's distribution exactly (rejection sampling).

    --decoding speculative --draft NAME          a draft model: named shape, cached model or folder
                                                  with the target's vocabulary; its own KV cache,
                                                  indexed by the target's block tables
    --decoding speculative --draft ngram         prompt lookup, no second model
    --decoding speculative --draft self --exit-layer L
                                                  the target's first L layers + final norm + LM head,
                                                  over the target's own KV cache
    --num-speculative-tokens K                    tokens proposed per request per step (default 4)

One step: the scheduler has reserved K lookahead slots per request. The proposer drafts up to K
tokens for every request that samples this step (batched over requests), then ONE target forward
runs each request's new tokens followed by its draft (query length k + 1, attending to the cached
context: the attention backends' extend path); prefill chunks ride in the same forward. The k + 1
logits rows of a request are checked (`rejection`), and `StepResult.num_computed` tells the
scheduler how many tokens' K/V stay valid: the accepted draft positions are kept, the rejected
ones are rolled back (their slots are overwritten later).
"""

from __future__ import annotations

import time

import torch

from infer.core.errors import ConfigError
from infer.core.hookspecs import hookimpl
from infer.core.interfaces import (
    Capabilities,
    DecoderContext,
    ScheduledSeq,
    SchedulerOutput,
    StepResult,
    VerifyingSampler,
)
from infer.core.runner import ForwardSeq, ModelRunner
from infer.plugins.decoders import rejection
from infer.plugins.decoders.proposers import DraftRow, ModelProposer, NgramProposer, Proposer, view


def make_proposer(ctx: DecoderContext) -> tuple[Proposer, str]:
    config, target = ctx.config, ctx.runner
    if config.draft == "ngram":
        return NgramProposer(), "ngram"
    if config.draft == "self":
        if config.exit_layer is None:
            raise ConfigError("--draft self needs --exit-layer L: the draft is the target's first L layers")
        runner = ModelRunner(
            target.model,
            target.attention,
            target.kv_caches,
            target.sampler,
            target.block_size,
            target.device,
            num_layers=config.exit_layer,
            executor=target.executor,  # the target's model: under tensor parallelism its forwards reach every rank
        )
        return ModelProposer(runner, shares_target_kv=True), f"self (first {config.exit_layer} layers)"
    if ctx.build_model is None:
        raise ConfigError(
            f"--draft {config.draft} needs a model builder, which this engine does not provide: use --draft ngram"
        )
    return ModelProposer(ctx.build_model(config.draft)), str(config.draft)


def _check_sampler(sampler: object, flag: str) -> None:
    if not isinstance(sampler, VerifyingSampler):
        raise ConfigError(
            f"{flag} {type(sampler).__name__} has no probs()/logprobs(), which speculative decoding needs "
            f"to verify draft tokens: use --sampler vectorized or naive"
        )


class SpeculativeDecoder:
    capabilities = Capabilities(needs_draft=True)

    def __init__(self, ctx: DecoderContext) -> None:
        self.target = ctx.runner
        self.k = ctx.config.num_speculative_tokens
        self.num_lookahead_tokens = self.k
        self.proposer, label = make_proposer(ctx)
        _check_sampler(self.target.sampler, "--sampler")
        self.describe = {"draft": label, "num_speculative_tokens": self.k}

    def max_draft(self, s: ScheduledSeq) -> int:
        """Tokens worth proposing: within K, the reserved slots, max_tokens and the context."""
        r = s.request
        if not s.samples or not r.params.tokens_are_final:  # the scheduler ranks beams' candidates one token at a time
            return 0
        n = r.num_tokens
        k = min(
            self.k, r.params.max_tokens - len(r.output_token_ids) - 1, len(r.block_ids) * self.target.block_size - n
        )
        if r.max_model_len:
            k = min(k, r.max_model_len - n - 1)
        return max(0, k)

    def execute(self, out: SchedulerOutput) -> StepResult:
        if not out.scheduled:
            return StepResult(sampled={})
        started = time.perf_counter()
        rows = [DraftRow(s.request, s.num_new_tokens, self.max_draft(s)) for s in out.scheduled]
        proposal = self.proposer.propose(rows)
        drafted = time.perf_counter()

        seqs = []
        for s, x in zip(out.scheduled, proposal.token_ids):
            r, c = s.request, s.request.num_computed_tokens
            new = [r.token_at(c)] if s.num_new_tokens == 1 else r.all_token_ids[c : c + s.num_new_tokens]
            seqs.append(ForwardSeq(r, new + x, c, len(x) + 1 if s.samples else 0))
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) != 1)  # decodes first
        logits = self.target.forward([seqs[i] for i in order])  # [sum(k_i + 1), V]
        verify = [i for i in order if seqs[i].logits_rows]
        result = self._accept(
            logits,
            [seqs[i] for i in verify],
            [proposal.token_ids[i] for i in verify],
            [proposal.probs[i] for i in verify],
        )
        verified = time.perf_counter()

        proposed = [len(x) for x in proposal.token_ids]
        accepted = [len(result.sampled[seqs[i].request.request_id]) - 1 for i in verify if proposed[i]]
        result.stats = {
            "spec_proposed": float(sum(proposed)),
            "spec_accepted": float(sum(accepted)),
            "spec_requests": float(len(accepted)),  # request-steps that carried a draft
            "spec_draft_s": drafted - started,
            "spec_verify_s": verified - drafted,
        }
        return result

    def _accept(
        self,
        logits: torch.Tensor,
        seqs: list[ForwardSeq],
        drafts: list[list[int]],
        draft_probs: list[torch.Tensor | None],
    ) -> StepResult:
        # logits: [sum(k_i + 1), V]; seqs[i] owns rows offsets[i] .. offsets[i] + k_i
        if not seqs:
            return StepResult(sampled={})
        device = logits.device
        offsets, views, positions = [], [], []
        for seq, x in zip(seqs, drafts):
            offsets.append(len(views))
            base = len(seq.request.output_token_ids)
            for j in range(len(x) + 1):
                views.append(view(seq.request, x[:j]))
                positions.append(base + j)
        p = self.target.sampler.probs(logits, views, positions)  # [T, V]
        K = max(len(x) for x in drafts)
        # index[i, j]: p's row for draft index j of seq i (rows past k_i repeat the last one)
        index = torch.tensor(
            [[o + min(j, len(x)) for j in range(K + 1)] for o, x in zip(offsets, drafts)], device=device
        )
        x = torch.tensor([d + [0] * (K - len(d)) for d in drafts], dtype=torch.int64, device=device).reshape(
            len(drafts), K
        )
        num_draft = torch.tensor([len(d) for d in drafts], device=device)
        greedy = [i for i, s in enumerate(seqs) if s.request.params.is_greedy]
        sampled = [i for i, s in enumerate(seqs) if not s.request.params.is_greedy]
        parts, owners = [], []
        if greedy:
            g = torch.tensor(greedy, device=device)
            parts += list(rejection.greedy_accept(x[g], num_draft[g], p.argmax(dim=-1)[index[g]]))
            owners.append(greedy)
        if sampled:
            s_idx = torch.tensor(sampled, device=device)
            q = self._draft_probs([draft_probs[i] for i in sampled], [drafts[i] for i in sampled], K, p)
            requests = [seqs[i].request for i in sampled]
            seeds = rejection.seed_tensor([r.seed for r in requests], device)
            base = torch.tensor([len(r.output_token_ids) for r in requests], dtype=torch.int64, device=device)
            parts += list(rejection.rejection_sample(x[s_idx], num_draft[s_idx], p[index[s_idx]], q, seeds, base))
            owners.append(sampled)
        flat = torch.cat(parts).tolist()  # the step's one device-to-host copy
        num_accepted, next_token = [0] * len(seqs), [0] * len(seqs)
        at = 0
        for group in owners:
            for j, i in enumerate(group):
                num_accepted[i], next_token[i] = flat[at + j], flat[at + len(group) + j]
            at += 2 * len(group)

        sampled_tokens: dict[str, list[int]] = {}
        num_computed: dict[str, int] = {}
        for seq, d, n, t in zip(seqs, drafts, num_accepted, next_token):
            r = seq.request
            sampled_tokens[r.request_id] = d[:n] + [t]
            num_computed[r.request_id] = seq.start + len(seq.token_ids) - len(d) + n  # rejected slots rolled back
        result = StepResult(sampled=sampled_tokens, num_computed=num_computed)
        if any(s.request.params.logprobs is not None for s in seqs):
            result.logprobs = self._logprobs(logits, seqs, offsets, views, sampled_tokens)
        return result

    @staticmethod
    def _draft_probs(
        probs: list[torch.Tensor | None], drafts: list[list[int]], K: int, p: torch.Tensor
    ) -> torch.Tensor | None:
        # -> [S, K, V] q of the sampled rows, zero-padded; None when the proposer is deterministic
        if all(q is None for q, d in zip(probs, drafts) if d):
            return None
        assert all(q is not None for q, d in zip(probs, drafts) if d), "a model proposer gives q for every draft"
        q = p.new_zeros(len(probs), K, p.shape[1])
        for i, rows in enumerate(probs):
            if rows is not None:
                q[i, : rows.shape[0]] = rows
        return q

    def _logprobs(
        self,
        logits: torch.Tensor,
        seqs: list[ForwardSeq],
        offsets: list[int],
        views: list,
        tokens: dict[str, list[int]],
    ) -> dict[str, list[dict[int, float]]]:
        rows, row_views, row_tokens, owners = [], [], [], []
        for seq, o in zip(seqs, offsets):
            r = seq.request
            if r.params.logprobs is None:
                continue
            emitted = tokens[r.request_id]
            rows += range(o, o + len(emitted))
            row_views += views[o : o + len(emitted)]
            row_tokens += emitted
            owners.append((r.request_id, len(emitted)))
        found = self.target.sampler.logprobs(logits[torch.tensor(rows, device=logits.device)], row_views, row_tokens)
        out, at = {}, 0
        for rid, n in owners:
            out[rid] = found[at : at + n]
            at += n
        return out

    def summarize(self, totals: dict[str, float]) -> dict[str, float]:
        """Run-level figures from the summed step stats (`Engine.stats`)."""
        proposed, accepted, steps = (totals.get(k, 0.0) for k in ("spec_proposed", "spec_accepted", "spec_requests"))
        verify = totals.get("spec_verify_s", 0.0)
        return {
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted_tokens": accepted / steps if steps else 0.0,  # draft tokens kept per request-step
            "mean_tokens_per_step": (accepted + steps) / steps if steps else 0.0,  # with the target's own token
            "draft_verify_time_ratio": totals.get("spec_draft_s", 0.0) / verify if verify else 0.0,
        }


@hookimpl
def infer_register_decoders(register) -> None:
    register("speculative", SpeculativeDecoder)
