"""Detokenization and stop conditions, per request, as tokens arrive."""

from __future__ import annotations

from dataclasses import dataclass

from .outputs import CompletionOutput, RequestOutput
from .request import Request


@dataclass
class _Progress:
    detok: object | None
    prompt_token_ids: list[int]  # one copy for all of the request's snapshots (see snapshot)
    text: str = ""
    sent_text: int = 0  # characters already streamed
    sent_tokens: int = 0
    held: int = 0  # trailing characters held back: they may start a stop string


class OutputProcessor:
    def __init__(self, tokenizer, spec_metrics: bool = False) -> None:
        self.tokenizer = tokenizer
        self.spec_metrics = spec_metrics  # speculative decoding is on: snapshots carry its counts
        self._progress: dict[str, _Progress] = {}

    def add(self, req: Request) -> None:
        detok = None
        if self.tokenizer is not None:
            from ..tokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=req.params.skip_special_tokens)
        self._progress[req.request_id] = _Progress(detok, list(req.prompt_token_ids))

    def process(self, req: Request) -> tuple[str | None, int | str | None]:
        """Account for the request's newest token; return (finish_reason, stop_reason)."""
        prog = self._progress[req.request_id]
        token = req.output_token_ids[-1]
        p = req.params
        n_out = len(req.output_token_ids)
        if token in p.stop_token_ids:
            return "stop", token
        if token in req.eos_token_ids:
            return "stop", None
        if prog.detok is not None:
            prog.text += prog.detok.push(token)
            if p.stop:
                hit = _find_stop(prog.text, p.stop, start=max(0, prog.sent_text - max(map(len, p.stop))))
                if hit is not None:
                    pos, stop = hit
                    prog.text = prog.text[: pos + len(stop)] if p.include_stop_str_in_output else prog.text[:pos]
                    prog.held = 0
                    return "stop", stop
                prog.held = _partial_stop_suffix(prog.text, p.stop)
        if n_out >= req.max_tokens:
            return "length", None
        return None, None

    def snapshot(self, req: Request) -> RequestOutput:
        prog = self._progress[req.request_id]
        finished = req.finished
        stopped_by_string = isinstance(req.stop_reason, str)
        if finished and prog.detok is not None and not stopped_by_string and hasattr(prog.detok, "flush"):
            prog.text += prog.detok.flush()  # an incomplete character at the very end
        visible = len(prog.text) if finished else len(prog.text) - prog.held
        delta_text = prog.text[prog.sent_text : visible]
        prog.sent_text = max(prog.sent_text, visible)
        delta_tokens = req.output_token_ids[prog.sent_tokens :]  # slices: fresh lists
        prog.sent_tokens = len(req.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=prog.text[:visible],
            token_ids=req.output_token_ids[:],
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
        )
        if finished:
            self._progress.pop(req.request_id, None)
        # every snapshot of a request shares one copy of its prompt (as vLLM's outputs do): a
        # 256-request decode step copied 256 prompts per step; the engine's own list stays apart
        return RequestOutput(
            req.request_id,
            req.prompt,
            prog.prompt_token_ids,
            [completion],
            finished,
            req.num_cached_tokens or 0,
            _spec_metrics(req) if self.spec_metrics else None,
        )

    def finish(self, req: Request) -> RequestOutput:
        return self.snapshot(req)

    def error(self, req: Request, message: str) -> RequestOutput:
        """The last output of a request the engine gave up on: the text already streamed, no
        new delta (detokenizing may be what failed), and the reason."""
        prog = self._progress.pop(req.request_id, None)
        text = prog.text[: prog.sent_text] if prog is not None else ""
        sent = prog.sent_tokens if prog is not None else len(req.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(req.output_token_ids),
            finish_reason="error",
            delta_token_ids=list(req.output_token_ids[sent:]),
            error=message,
        )
        return RequestOutput(
            req.request_id, req.prompt, list(req.prompt_token_ids), [completion], True, req.num_cached_tokens or 0
        )


def _spec_metrics(req: Request) -> dict:
    return {
        "spec_num_drafts": req.num_drafts,
        "spec_num_draft_tokens": req.num_draft_tokens,
        "spec_num_accepted_tokens": req.num_accepted_tokens,
    }


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best = None
    for stop in stops:
        pos = text.find(stop, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


def _partial_stop_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-k:]):
                longest = k
                break
    return longest
