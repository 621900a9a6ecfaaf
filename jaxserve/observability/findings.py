"""The records of a `jaxserve diagnose` (`observability.diagnose`, `.diagnose_bench`):
each branch of the tree that holds is a `Finding`; a `Diagnosis` holds them, the first
being the suspect, and renders them for a person (`render`) or a machine (`to_json`).
No JAX here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Finding:
    """One branch of the tree that holds: its layer, the numbers, the next step."""

    layer: str
    symptom: str
    numbers: dict[str, float | str]
    next: str


@dataclass
class Diagnosis:
    """The findings, the first being the suspect; `summary` holds the window's numbers."""

    source: str
    findings: list[Finding]
    summary: dict[str, float | str] = field(default_factory=dict)
    note: str = ""

    @property
    def layer(self) -> str | None:
        return self.findings[0].layer if self.findings else None

    def to_json(self) -> dict:
        findings = [asdict(f) for f in self.findings]
        return {"source": self.source, "layer": self.layer, "note": self.note,
                "summary": self.summary, "findings": findings}  # fmt: skip

    def render(self) -> str:
        """A few lines a person can act on."""
        lines = [f"jaxserve diagnose: {self.source}"]
        s = self.summary
        if s:
            lines.append("  " + ", ".join(f"{k} {_fmt(v)}" for k, v in s.items()))
        if not self.findings:
            lines.append(self.note or "healthy: no layer holds the server back")
            return "\n".join(lines)
        for i, f in enumerate(self.findings):
            head = "suspect" if i == 0 else "also"
            lines.append(f"{head}: {f.layer}: {f.symptom}")
            lines.append("  " + ", ".join(f"{k} {_fmt(v)}" for k, v in f.numbers.items()))
            lines.append(f"  next: {f.next}")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)
