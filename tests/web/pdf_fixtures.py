"""Tiny PDFs written by hand for the documents tests: one page per entry, each page showing its
text in Helvetica, or (None) a drawn line and no text at all, as a scanned page has none."""
from __future__ import annotations


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def make_pdf(pages: list[str | None]) -> bytes:
    """A valid PDF 1.4 file (cross-reference table with true offsets) of `pages`."""
    n = len(pages)
    # objects: 1 catalog, 2 page tree, 3 font, then per page: its page object and its content
    page_ids = [4 + 2 * i for i in range(n)]
    objects = {1: b"<< /Type /Catalog /Pages 2 0 R >>",
               2: b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % p for p in page_ids) + b"] /Count %d >>" % n,
               3: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"}
    for pid, text in zip(page_ids, pages):
        stream = (b"0 0 m 200 200 l S" if text is None else
                  b"BT /F1 12 Tf 72 720 Td (" + _escape(text).encode("latin-1") + b") Tj ET")
        objects[pid] = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                        b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % (pid + 1))
        objects[pid + 1] = b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream"
    out, offsets = bytearray(b"%PDF-1.4\n"), {}
    for oid in sorted(objects):
        offsets[oid] = len(out)
        out += b"%d 0 obj\n" % oid + objects[oid] + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offsets[oid] for oid in sorted(objects))
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)
