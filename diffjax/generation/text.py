"""A sequence's text as its tokens come: :class:`TextStream`, shared by the server's streams
and ``python -m diffjax.generation``."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from diffjax.data import ByteTokenizer, Tokenizer

# Prompt ids a stream decodes its first tokens after: enough for a token's text to be what it
# is after the prompt (SentencePiece drops the leading space of a sequence's first token).
CONTEXT_IDS = 4


class TextStream:
  """A choice's text as tokens arrive: text is released only when it is whole (no cut UTF-8
  character) and cannot be the start of a stop string; the text ends before the first stop
  string.

  ``context``: the ids before the first token (the prompt; its last :data:`CONTEXT_IDS` are
  used): the text is what the tokens add to them, never their own text.
  """

  def __init__(self, tok: Tokenizer, stops: Sequence[str] = (), context: Sequence[int] = ()):
    self.tok, self.stops = tok, [s for s in stops if s]
    context = [int(i) for i in context][-CONTEXT_IDS:]
    self.ids: list[int] = list(context)  # the context's ids, then the tokens'
    self.byte_level = isinstance(tok, ByteTokenizer)
    self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    self.text = ""  # all decoded text so far
    self.sent = 0  # characters of it released
    self.stopped = False
    # Other tokenizers decode a window: ids[start:] against ids[start:done], where the text of
    # ids[:done] is known and whole (a token's text can depend on the one before it). The
    # window starts inside the context; the context's own text (less a cut character at its
    # end, which a token may complete) is never part of the stream's.
    self._start, self._done = 0, len(context)
    self._base = 0
    if self.byte_level:
      self.utf8.decode(bytes(t for t in context if t < 256))  # a cut character goes on
    elif context:
      self._base = len(self.tok.decode(context).rstrip("\ufffd"))

  def _decoded(self, token: int) -> str:
    self.ids.append(token)
    if self.byte_level:
      if token < 256:
        self.text += self.utf8.decode(bytes([token]))
      return self.text
    # Decoding from the same start on both sides cancels a tokenizer's rule for the first
    # token (SentencePiece drops its leading space), so each token costs a few ids' decoding
    # rather than the whole sequence's.
    known = self.tok.decode(self.ids[self._start : self._done])
    now = self.tok.decode(self.ids[self._start :])
    if len(now) <= len(known) or now.endswith("\ufffd"):  # nothing whole yet
      return self.text
    if not now.startswith(known):  # the new token changed the text before it: decode it all
      self._start, self._done = 0, len(self.ids)
      return self._whole()
    self._start, self._done = self._done, len(self.ids)
    return self.text + now[len(known) :]

  def _whole(self) -> str:
    """The text of every id after the context's, decoded at once."""
    return self.tok.decode(self.ids)[self._base :]

  def add(self, token: int) -> str:
    """The text released by ``token`` (sets ``stopped`` when a stop string appears)."""
    if self.stopped:
      return ""
    text = self._decoded(token)
    if not self.byte_level:
      self.text = text
    return self._release_checked(final=False)

  def finish(self) -> str:
    """The text still held back, once no token follows (ending before a stop string in it)."""
    if self.stopped:
      return ""
    if self.byte_level:
      self.text += self.utf8.decode(b"", final=True)
    else:
      self.text = self._whole()
    return self._release_checked(final=True)

  def _release_checked(self, final: bool) -> str:
    """Releases ``text`` up to the first stop string in it (and sets ``stopped``), else up to
    the longest tail that may begin one (all of it when ``final``)."""
    text, cut = self.text, None
    for stop in self.stops:
      at = text.find(stop, max(0, self.sent - len(stop)))
      if at >= 0 and (cut is None or at < cut):
        cut = at
    if cut is not None:
      self.stopped, self.text = True, text[:cut]
      return self._release(cut)
    hold = 0  # the longest tail that begins a stop string
    for stop in self.stops if not final else ():
      for k in range(min(len(stop) - 1, len(text)), hold, -1):
        if text.endswith(stop[:k]):
          hold = k
          break
    return self._release(len(text) - hold)

  def _release(self, upto: int) -> str:
    piece = self.text[self.sent : upto] if upto > self.sent else ""
    self.sent = max(self.sent, upto)
    return piece
