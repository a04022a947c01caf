"""A file attached in the chat page read as text: a PDF's text layer (pypdf), or a text,
markdown or code file decoded from its charset; then framed for the message it goes into.

What is refused, each a 400 naming the file: bytes that are neither a PDF nor text (a NUL byte:
a picture, an archive, an executable), text that is not valid in its charset (UTF-8 unless the
data: URI names one or a byte-order mark says UTF-16), a PDF pypdf cannot read or decrypt, a
PDF with no text layer (pictures of pages: a scan), and text past MAX_CHARS (more than any
context holds). The framing, `frame`, is the one place the message's layout is written:

    File: report.pdf (PDF, 3 pages)       <- the header: the name, and for a PDF its pages
    ````                                  <- a fence longer than any run of backticks inside
    ...the text...
    ````
"""
from __future__ import annotations

import codecs
import io
import re
from dataclasses import dataclass

from appliance.errors import InvalidRequest

MAX_CHARS = 4_000_000      # about a million tokens: more than any model's context
MAX_NAME = 255             # a file name's characters
PDF_MAGIC = b"%PDF-"
_BOMS = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


@dataclass(frozen=True)
class Document:
    name: str
    kind: str              # "pdf" or "text"
    pages: int | None      # a PDF's page count; None for text
    text: str


def read(name: str, raw: bytes, media_type: str = "", charset: str | None = None) -> Document:
    """The file's text; InvalidRequest (param "data") for every way it cannot be read."""
    if PDF_MAGIC in raw[:1024]:     # the header may follow a little junk, as PDF readers allow
        return _pdf(name, raw)
    if media_type == "application/pdf" or name.lower().endswith(".pdf"):
        raise InvalidRequest(f"{name} is not a PDF (it does not begin with {PDF_MAGIC.decode()})", param="data")
    return Document(name, "text", None, _decode(name, raw, charset))


def frame(doc: Document) -> str:
    """The document as it goes into a user message: a header naming it, then its text fenced."""
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", doc.text)), default=0))
    what = f" (PDF, {doc.pages} page{'s' if doc.pages != 1 else ''})" if doc.kind == "pdf" else ""
    return f"File: {doc.name}{what}\n{fence}\n{doc.text.rstrip(chr(10))}\n{fence}"


def _decode(name: str, raw: bytes, charset: str | None) -> str:
    encoding = next((enc for bom, enc in _BOMS if raw.startswith(bom)), None)
    if encoding is None and charset:
        try:
            encoding = codecs.lookup(charset).name
        except LookupError:
            raise InvalidRequest(f"{name}: unknown charset '{charset}'", param="data") from None
    if encoding is None and b"\0" in raw:
        raise InvalidRequest(f"{name} is not a text, markdown, code or PDF file (it holds binary bytes)",
                             param="data")
    encoding = encoding or "utf-8"
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"{name} is not valid {encoding} text: byte 0x{raw[e.start]:02x} at offset "
                             f"{e.start:,} does not decode; save the file as UTF-8", param="data") from None
    _check_length(name, len(text))
    return text


def _check_length(name: str, chars: int) -> None:
    if chars > MAX_CHARS:
        raise InvalidRequest(f"{name} has more than {MAX_CHARS:,} characters of text: more than any "
                             "model's context holds", param="data")


def _pdf(name: str, raw: bytes) -> Document:
    import pypdf

    try:
        reader = pypdf.PdfReader(io.BytesIO(raw))
        if reader.is_encrypted and not reader.decrypt(""):
            raise InvalidRequest(f"{name} is encrypted with a password; save an unprotected copy", param="data")
        pages, chars = [], 0
        for page in reader.pages:
            pages.append(page.extract_text() or "")
            chars += len(pages[-1])
            _check_length(name, chars)
    except InvalidRequest:
        raise
    except Exception as e:  # noqa: BLE001 - a hostile or broken file can fail anywhere in the parser
        raise InvalidRequest(f"{name} is not a PDF this server can read ({type(e).__name__})", param="data") from None
    if not pages:
        raise InvalidRequest(f"{name} is not a PDF this server can read (it has no pages)", param="data")
    if not any(p.strip() for p in pages):
        n = len(pages)
        raise InvalidRequest(f"{name} has no text layer ({n} page{'s' if n != 1 else ''} of pictures only, "
                             "a scan?): run it through OCR first, or paste its text", param="data")
    return Document(name, "pdf", len(pages), "\n\n".join(p.strip("\n") for p in pages))
