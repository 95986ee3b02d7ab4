"""Stop strings across the prefill/decode boundary.

Each engine cuts its own output at a stop string, but one that starts in the prefill's first
token and ends in decode's output is seen by neither. The router therefore runs the text
through `StopFilter`, which holds back the last len(stop)-1 characters (as vLLM's detokenizer
does) so it never emits text that turns out to begin a stop string.
"""

from __future__ import annotations


class StopFilter:
    def __init__(self, stops: list[str], include: bool = False):
        """`include`: the stop string stays at the end of the output (vLLM's include_stop_str_in_output),
        and text is released at once, as vLLM releases it then."""
        self._stops = [s for s in stops if s]
        self._include = include
        self._lookback = max((len(s) for s in self._stops), default=1) - 1  # a stop may begin this far back
        self._hold = 0 if include else self._lookback
        self._text = ""  # everything received
        self._emitted = 0  # characters of it already released

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Text safe to release now, and the stop string reached, if one was (then nothing follows): as
        vLLM's detokenizer picks it, the one that ends earliest in the text, of two ending together the
        first listed."""
        if not self._stops:
            return delta, None
        self._text += delta
        search_from = max(self._emitted - self._lookback, 0)
        hits = [(i, stop) for stop in self._stops if (i := self._text.find(stop, search_from)) != -1]
        if hits:
            start, stop = min(hits, key=lambda hit: hit[0] + len(hit[1]))
            end = start + len(stop) if self._include else start
            out, self._emitted = self._text[self._emitted : end], max(end, self._emitted)
            return out, stop
        safe = max(len(self._text) - self._hold, self._emitted)
        out, self._emitted = self._text[self._emitted : safe], safe
        return out, None

    def flush(self) -> str:
        """The held-back tail, once the output ended for another reason."""
        if not self._stops:
            return ""
        out, self._emitted = self._text[self._emitted :], len(self._text)
        return out
