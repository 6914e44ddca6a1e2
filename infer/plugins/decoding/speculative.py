"""`speculative`: propose k tokens cheaply, verify them with one target forward, keep what the
target would have produced. Lossless: every emitted token is the target's own choice at its
position (greedy: its argmax; sampled: rejection sampling, which follows its distribution exactly).

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
checks them. A decoding request's new token and its k drafts run as k + 1 decode rows, one per
position, each attending to the cache up to its own position (the rows' K/V are all written before
any is read: the attention backend's `writes_kv_first`). A step of such rows is decode-only, so the
target replays the CUDA graph of its row count, as a plain decode step does; a backend without
that promise verifies each request as one sequence of k + 1 query tokens (the extend path),
eagerly. Prefill chunks ride in the same forward (which then runs eagerly). The k + 1 logits rows
of a request are checked (`rejection`), and `StepResult.num_computed` tells the scheduler how many
tokens' K/V stay valid: the accepted draft positions are kept, the rejected ones are rolled back
(their slots are overwritten later). The host waits for the GPU once per step, for the accepted
counts and the draft tokens together.

A verify step cannot be queued before the step it follows has reached the host (its inputs are the
tokens that step accepts), so its host work sits between two forwards. A step where nothing was
drafted (prompt lookup found no match) is a plain step through the runner instead: with decode
pipelining it takes the forward queued ahead at the step before when that was one too, and queues
the next, betting that it drafts nothing either. A step that drafts after such a forward takes its
new tokens' rows from it and verifies only the drafts (k decode rows, not k + 1), or drops it.

In fp32 the output is autoregressive decoding's, token for token. In bf16 it is what the target
computes in the verify forward: its logits move in the last bits with the shape of the step (the
linear layers reduce in an order set by the row count, and so does the decode kernel's split of
a context), as autoregressive decoding's move with its batch size, so at a near-tie the greedy
text may take the other branch (docs/performance.md, "Speculative verification in bf16").
"""

from __future__ import annotations

import time

import torch

from infer.api import (
    Capabilities,
    DecoderContext,
    ScheduledSeq,
    SchedulerOutput,
    StepResult,
    TokenSampler,
    VerifyingSampler,
)
from infer.api.constrain import constrain, constrain_ahead, is_constrained
from infer.api.errors import ConfigError
from infer.api.hookspecs import hookimpl
from infer.api.prompt_logprobs import prompt_rows, take_prompt_logprobs
from infer.api.request import Request
from infer.api.runner import ForwardSeq
from infer.api.transfer import to_device
from infer.plugins.decoding import rejection
from infer.plugins.decoding.proposers import (
    DraftRow,
    ModelProposer,
    NgramProposer,
    Proposal,
    Proposer,
    has_penalties,
    view,
)


def make_proposer(ctx: DecoderContext, rows_upto: int) -> tuple[Proposer, str]:
    config = ctx.config
    if config.draft == "ngram":
        return NgramProposer(), "ngram"
    if config.draft == "self" and config.exit_layer is None:
        raise ConfigError("--draft self needs --exit-layer L: the draft is the target's first L layers")
    build = ctx.share_model if config.draft == "self" else ctx.build_model
    if build is None:
        raise ConfigError(
            f"--draft {config.draft} needs a model builder, which this engine does not provide: use --draft ngram"
        )
    if config.draft == "self":
        runner = build(config.exit_layer)  # the target's first layers over its own KV cache
        return ModelProposer(runner, True, rows_upto), f"self (first {config.exit_layer} layers)"
    return ModelProposer(build(config.draft), rows_upto=rows_upto), str(config.draft)


def _check_sampler(sampler: object, flag: str) -> None:
    if not isinstance(sampler, VerifyingSampler):
        raise ConfigError(
            f"{flag} {type(sampler).__name__} has no probs()/logprobs(), which speculative decoding needs "
            f"to verify draft tokens: use --sampler vectorized or naive"
        )


class SpeculativeDecoder:
    # cuda_graph_safe: a step whose verify is all decode rows replays the target's graphs;
    # pipeline_safe: a step with no draft is a plain step, queued ahead by the step before it if that was one
    capabilities = Capabilities(needs_draft=True, cuda_graph_safe=True, pipeline_safe=True)

    def __init__(self, ctx: DecoderContext) -> None:
        self.target = ctx.runner
        self.waits = ctx.waits
        self.k = ctx.config.num_speculative_tokens
        self.num_lookahead_tokens = self.k
        self.as_rows = self.target.attention.capabilities.writes_kv_first  # verify as decode rows
        self.proposer, label = make_proposer(ctx, self.k + 1 if self.as_rows else 0)
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
        proposal = self.proposer.propose(
            [DraftRow(s.request, s.num_new_tokens, self.max_draft(s)) for s in out.scheduled]
        )
        drafted = time.perf_counter()
        proposed = proposal.num_tokens
        if not any(proposed):
            # nothing to verify: a plain step, which takes the forward queued ahead at the step before
            # when it computed this step, and may queue the next one (tokens are the verify's: a row
            # with no draft samples what the sampler would)
            result = self.target.execute(out)
            verify = []
        else:
            ahead = self._take_ahead(out.scheduled)
            order, logits = self._verify(out.scheduled, proposal, ahead)  # logits: [sum(k_i + 1), V]
            verify = [i for i in order if out.scheduled[i].samples]
            result = self._accept(logits, out.scheduled, verify, proposal)
        verified = time.perf_counter()
        accepted = [len(result.sampled[out.scheduled[i].request.request_id]) - 1 for i in verify if proposed[i]]
        result.stats = {
            "spec_proposed": float(sum(proposed)),
            "spec_accepted": float(sum(accepted)),
            "spec_requests": float(len(accepted)),  # request-steps that carried a draft
            "spec_draft_s": drafted - started,
            "spec_verify_s": verified - drafted,
        }
        return result

    def _take_ahead(self, scheduled: list[ScheduledSeq]) -> tuple[list[int], torch.Tensor] | None:
        """When the step before drafted nothing and queued this step's forward ahead, and every decoding
        request's new token is what it computed: those requests (scheduled indices) and their logits
        [len, V], whose rows the verify then need not compute again. Else None (the forward is dropped)."""
        pipeline = self.target.pipeline
        rows = [i for i, s in enumerate(scheduled) if s.num_new_tokens == 1 and s.samples]
        # a self-draft wrote its layers' K/V at the new token's position since: the verify rewrites it
        if pipeline is None or not rows or self.proposer.shares_target_kv:
            self.target.discard_ahead()
            return None
        firsts = []
        for i in rows:
            r = scheduled[i].request
            firsts.append(ForwardSeq(r, [r.token_at(r.num_computed_tokens)], r.num_computed_tokens, 1))
        logits = pipeline.take(firsts)
        # copied: the verify may replay the graph whose output buffer holds these rows
        return None if logits is None else (rows, logits.clone())

    def _verify(
        self, scheduled: list[ScheduledSeq], proposal: Proposal, ahead: tuple[list[int], torch.Tensor] | None = None
    ) -> tuple[list[int], torch.Tensor]:
        """The target's forward over every request's new tokens and draft (a new token computed ahead
        only its draft). Returns the requests' order in it (decodes first) and the logits, k_i + 1 rows
        per request that samples."""
        on_device = isinstance(proposal.token_ids, torch.Tensor)
        computed = set(ahead[0]) if ahead is not None else set()
        groups: list[tuple[int, list[ForwardSeq]]] = []
        for i, s in enumerate(scheduled):
            r, c, k = s.request, s.request.num_computed_tokens, proposal.num_tokens[i]
            new = [r.token_at(c)] if s.num_new_tokens == 1 else r.all_token_ids[c : c + s.num_new_tokens]
            draft = [0] * k if on_device else proposal.token_ids[i]  # device drafts: filled in on the device
            if i in computed:  # its new token's row (and K/V) came from the forward queued ahead
                new, c = [], c + 1
            if self.as_rows and s.num_new_tokens == 1 and s.samples:
                groups.append((i, [ForwardSeq(r, [t], c + j, 1) for j, t in enumerate(new + draft)]))
            elif new or draft:
                rows = k + (i not in computed) if s.samples else 0  # the new token's row unless taken ahead
                groups.append((i, [ForwardSeq(r, new + draft, c, rows, prompt_rows(r, c, len(new)))]))
            else:
                groups.append((i, []))
        groups.sort(key=lambda g: bool(g[1]) and len(g[1][0].token_ids) != 1)  # decodes first
        ids = self._device_ids(groups, proposal) if on_device and any(proposal.num_tokens) else None
        seqs = [seq for _, group in groups for seq in group]
        logits = take_prompt_logprobs(self.target.forward(seqs, input_ids_t=ids), seqs)  # prompt rows scored, dropped
        if ahead is not None:  # each such request's first row from the forward queued ahead
            logits = _with_rows_ahead(logits, groups, *ahead)
        return [i for i, _ in groups], logits

    def _device_ids(self, groups: list[tuple[int, list[ForwardSeq]]], proposal: Proposal) -> torch.Tensor:
        # the forward's input ids [T] on the device: the new tokens from the host, each request's
        # draft (the last k_i of its tokens) from the proposal's [rows, W] tensor
        drafts = proposal.token_ids
        assert isinstance(drafts, torch.Tensor)
        width = drafts.shape[1]
        host: list[int] = []
        dst: list[int] = []
        src: list[int] = []
        for i, group in groups:
            for seq in group:
                host += seq.token_ids
            k = proposal.num_tokens[i]
            dst += range(len(host) - k, len(host))
            src += range(i * width, i * width + k)
        packed = to_device(host + dst + src, torch.int64, drafts.device)  # one copy
        ids, dst_t, src_t = packed.split([len(host), len(dst), len(src)])
        ids[dst_t] = drafts.view(-1)[src_t]
        return ids

    def _accept(
        self, logits: torch.Tensor, scheduled: list[ScheduledSeq], verify: list[int], proposal: Proposal
    ) -> StepResult:
        # logits: [sum(k_i + 1), V]; verify[a] (a scheduled index) owns rows offsets[a] .. offsets[a] + k_a
        if not verify:
            return StepResult(sampled={})
        device = logits.device
        requests = [scheduled[i].request for i in verify]
        num_draft = [proposal.num_tokens[i] for i in verify]
        K = max(num_draft)
        # x: [R, K] on the device, or None; drafts: on the host, or None
        x, drafts = _drafts(proposal, verify, K, device)
        constrained = is_constrained(requests)
        if drafts is None and (constrained or any(k and has_penalties(r) for r, k in zip(requests, num_draft))):
            assert x is not None
            self.waits.waiting()
            drafts = [row[:k] for row, k in zip(x.tolist(), num_draft)]  # penalties, masks read the draft: wait for it
        offsets, views, positions = _rows(requests, num_draft, drafts)
        if constrained:  # each row masked after the draft before it (a row past a refused token is never kept)
            assert drafts is not None
            row_requests = [r for r, k in zip(requests, num_draft) for _ in range(k + 1)]
            constrain(logits, row_requests, [d[:j] for d, k in zip(drafts, num_draft) for j in range(k + 1)])
        choices = self._greedy_choices(logits, requests, views, positions)  # [T] the target's token per row
        if choices is not None and drafts is not None:  # one copy of the choices; the prefixes matched here
            self.waits.waiting()
            num_accepted, next_token = _match(choices.tolist(), offsets, drafts)
        else:
            q_rows = [proposal.probs[i] for i in verify]
            num_accepted, next_token, drafts = rejection.accept_on_device(
                self.target.sampler,
                logits,
                requests,
                num_draft,
                q_rows,
                x,
                drafts,
                (offsets, views, positions),
                choices,
                self.waits,
            )
        sampled_tokens: dict[str, list[int]] = {}
        num_computed: dict[str, int] = {}
        for i, r, d, n, t in zip(verify, requests, drafts, num_accepted, next_token):
            sampled_tokens[r.request_id] = d[:n] + [t]
            # K/V stay valid up to the accepted draft: the rejected positions' slots are rolled back
            num_computed[r.request_id] = r.num_computed_tokens + scheduled[i].num_new_tokens + n
        if constrained:  # the matchers take the accepted tokens beside the engine's host work
            constrain_ahead(requests, [sampled_tokens[r.request_id] for r in requests])
        result = StepResult(sampled=sampled_tokens, num_computed=num_computed)
        if any(r.params.logprobs is not None for r in requests):
            result.logprobs = self._logprobs(logits, requests, offsets, views, sampled_tokens)
        return result

    def _greedy_choices(
        self, logits: torch.Tensor, requests: list[Request], views: list, positions: list[int]
    ) -> torch.Tensor | None:
        """When every request is greedy: the token the target chooses at each row ([T] int64 on the
        device; penalties applied as `sample` applies them), with no distribution built. Else None."""
        sampler = self.target.sampler
        if not isinstance(sampler, TokenSampler) or not all(r.params.is_greedy for r in requests):
            return None
        return sampler.sample_tokens(logits, views, positions)  # None where the sampler cannot

    def _logprobs(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        offsets: list[int],
        views: list,
        tokens: dict[str, list[int]],
    ) -> dict[str, list[dict[int, float]]]:
        rows, row_views, row_tokens, owners = [], [], [], []
        for r, o in zip(requests, offsets):
            if r.params.logprobs is None:
                continue
            emitted = tokens[r.request_id]
            rows += range(o, o + len(emitted))
            row_views += views[o : o + len(emitted)]
            row_tokens += emitted
            owners.append((r.request_id, len(emitted)))
        found = self.target.sampler.logprobs(logits[to_device(rows, torch.int64, logits.device)], row_views, row_tokens)
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


def _rows(
    requests: list[Request], num_draft: list[int], drafts: list[list[int]] | None
) -> tuple[list[int], list, list[int]]:
    """Request a's k_a + 1 logits rows: where they start, the request as each row's sampler sees it
    (its draft so far counted where penalties read it), and each row's output index."""
    offsets, views, positions = [], [], []
    for a, (r, k) in enumerate(zip(requests, num_draft)):
        offsets.append(len(views))
        base = len(r.output_token_ids)
        for j in range(k + 1):
            views.append(view(r, drafts[a][:j] if drafts is not None else []))
            positions.append(base + j)
    return offsets, views, positions


def _with_rows_ahead(
    logits: torch.Tensor, groups: list[tuple[int, list[ForwardSeq]]], rows: list[int], ahead: torch.Tensor
) -> torch.Tensor:
    """The verify's logits ([T, V], groups' rows in order) with each request of `rows` given its first
    row from `ahead` ([len(rows), V]): the layout of a verify that computed every row itself."""
    first = {i: a for a, i in enumerate(rows)}
    index: list[int] = []
    at = 0
    for i, group in groups:
        if i in first:
            index.append(logits.shape[0] + first[i])
        n = sum(seq.logits_rows for seq in group)
        index += range(at, at + n)
        at += n
    return torch.cat([logits, ahead])[to_device(index, torch.int64, logits.device)]


def _match(choices: list[int], offsets: list[int], drafts: list[list[int]]) -> tuple[list[int], list[int]]:
    """Greedy acceptance on the host: each draft's longest prefix equal to the target's choices at its
    rows (`choices[offsets[a] + j]`: the target's token after draft token j - 1), then the target's
    own token after it."""
    num_accepted, next_token = [], []
    for o, d in zip(offsets, drafts):
        n = 0
        while n < len(d) and d[n] == choices[o + n]:
            n += 1
        num_accepted.append(n)
        next_token.append(choices[o + n])
    return num_accepted, next_token


def _drafts(
    proposal: Proposal, verify: list[int], K: int, device: torch.device
) -> tuple[torch.Tensor | None, list[list[int]] | None]:
    """The drafts of the `verify` rows: as x [R, K] int64 on the device (zero-padded) where the
    proposer left them there (drafts None), else as host lists (x None: made when a kernel needs it)."""
    if isinstance(proposal.token_ids, torch.Tensor):
        rows = proposal.token_ids
        if verify != list(range(rows.shape[0])):
            rows = rows[to_device(verify, torch.int64, device)]
        return rows[:, :K], None
    return None, [proposal.token_ids[i] for i in verify]


@hookimpl
def infer_register_decoders(register) -> None:
    register("speculative", SpeculativeDecoder)
