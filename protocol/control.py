"""Control messages between the launcher and its children."""

from dataclasses import dataclass, field

from .codec import expect_dict, expect_len, expect_str


@dataclass(slots=True)
class Ready:
    """A process is up. `info` carries what its peers need (e.g. kv_capacity)."""

    TAG = 1
    process: str
    info: dict = field(default_factory=dict)

    def to_wire(self):
        return [self.process, self.info]

    @classmethod
    def from_wire(cls, f):
        expect_len(f, 2, "Ready")
        return cls(expect_str(f[0], "process"), expect_dict(f[1], "info"))
