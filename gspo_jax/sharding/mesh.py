"""The device mesh: its axes, their sizes from `config.mesh`, and the mesh itself.

Mesh axes: data (batch only), fsdp (batch + parameters, ZeRO-3 style), tensor (heads, mlp,
vocab), expert (MoE experts; batch too, so expert devices never duplicate dense work).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

MESH_AXES = ("data", "fsdp", "tensor", "expert")
BATCH_AXES = ("data", "fsdp", "expert")


def mesh_shape(axis_sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Resolve the mesh axes (`config.mesh`: one may be -1) to sizes whose product is
    num_devices. Raises ValueError naming the field."""
    sizes = {axis: axis_sizes[axis] for axis in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"only one mesh axis may be -1, got {free}")
    for axis, size in sizes.items():
        if size != -1 and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"config.mesh.{axis}={size!r} must be a positive int or -1")
    fixed = int(np.prod([s for s in sizes.values() if s != -1]))
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"mesh axes {sizes} leave {num_devices} devices / {fixed} = "
                f"{num_devices / fixed} for mesh.{free[0]}"
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(f"mesh {sizes} has {fixed} devices, but {num_devices} are present")
    return sizes


def data_parallel_size_of(axis_sizes: Mapping[str, int]) -> int:
    """Devices a batch is split over (mesh.data x fsdp x expert) for resolved axis sizes."""
    return int(np.prod([axis_sizes[a] for a in BATCH_AXES]))


def make_mesh(axis_sizes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with MESH_AXES of the given (resolved, positive) sizes over `devices`.

    Axis types are Auto: ordinary tensor-parallel code under Explicit axes fails with
    "Contracting dimensions are sharded" (docs/jax_notes.md).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(int(axis_sizes[a]) for a in MESH_AXES)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, shape))} needs {np.prod(shape)} devices, got {len(devices)}"
        )
    return jax.make_mesh(
        shape,
        MESH_AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
    )
