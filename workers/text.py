"""Incremental text for streaming: what can be sent now, and where a stop string cuts."""

from __future__ import annotations


class IncrementalText:
    """Feeds on the full decoded completion after each token; hands out safe-to-send deltas.

    Text is held back while it could still become a stop string (a suffix that is a prefix
    of one) or ends in an incomplete UTF-8 sequence (U+FFFD from a partial byte token).
    """

    __slots__ = ("stop", "sent", "stopped")

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.sent = 0
        self.stopped = False

    def update(self, text: str, final: bool = False) -> str:
        """Return the new text to send; sets ``stopped`` when a stop string appeared."""
        cut = len(text)
        for s in self.stop:
            i = text.find(s, max(0, self.sent - len(s) + 1))
            if i != -1 and i < cut:
                cut = i
                self.stopped = True
        if self.stopped or final:
            end = cut
        else:
            end = len(text.rstrip("\ufffd"))
            hold = 0
            for s in self.stop:
                for k in range(min(len(s) - 1, end), hold, -1):
                    if text.endswith(s[:k], 0, end):
                        hold = k
                        break
            end -= hold
        if end <= self.sent:
            return ""
        out = text[self.sent : end]
        self.sent = end
        return out
