"""`ImageHandle`: how another process reaches an image of the shadow's, without torch (`status` reads handles)."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict


class ImageHandle(BaseModel):
    """An image (or an intake buffer) as another process reaches it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pid: int
    """The owning process (the shadow)."""
    fd: int
    """Its descriptor in the owner: `/proc/<pid>/fd/<fd>` on the owner's node (-1: private memory)."""
    memfd: str | None = None
    """The memfd's unique name, which a reader checks after opening; None: private memory, read through Ray."""
    node_id: str | None
    """The owner's Ray node (None outside Ray): a reader elsewhere streams it instead of opening it."""
    token: str
    """Names this buffer for `give_back` (the owner's incarnation and a serial)."""
    step: int | None
    """The step the image holds (None for an intake buffer, written by the reader)."""
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"

    @classmethod
    def of(cls, buffer, layout, token: str, step: int | None, node_id: str | None = None) -> "ImageHandle":
        """The handle of this process's `buffer` (an `image.ImageBuffer`) holding `layout` (an `image.ImageLayout`)."""
        return cls(pid=os.getpid(), fd=buffer.fd, memfd=buffer.name if buffer.shared else None, node_id=node_id, token=token, step=step, names=layout.names,
                   dtypes=layout.dtypes, shapes=layout.shapes)
