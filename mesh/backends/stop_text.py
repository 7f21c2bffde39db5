"""Stop strings matched on an answer's text as it comes, for a backend whose engine does not
match them (or matches them badly)."""

from __future__ import annotations


class StopText:
    """Stop strings matched on the text as it comes: what could begin one is held back until
    it cannot, and the text is cut where one begins. llama-cpp-python's own matching, at the
    end of a stream, decoded the tokens it held back one at a time and dropped the halves of a
    character: an emoji answer lost two emoji and still finished ``length``."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.held = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """What of ``text`` may go out now (:attr:`hit` once a stop string began)."""
        if not self.stops:
            return text
        text, self.held = self.held + text, ""
        cuts = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
        if cuts:
            self.hit = True
            return text[: min(cuts)]
        keep = max((overlap(text, stop) for stop in self.stops), default=0)
        if keep:
            text, self.held = text[:-keep], text[-keep:]
        return text

    def flush(self) -> str:
        """What is held back, at the end (no stop string came)."""
        held, self.held = self.held, ""
        return held


def overlap(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that begins ``stop`` (shorter than it)."""
    sizes = range(min(len(stop) - 1, len(text)), 0, -1)
    return next((size for size in sizes if text.endswith(stop[:size])), 0)
