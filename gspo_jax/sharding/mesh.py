"""The device mesh: its axes, their sizes from `config.mesh`, and the mesh itself.

Mesh axes: data (batch only), fsdp (batch + parameters, ZeRO-3 style), tensor (heads, mlp,
vocab), expert (MoE experts; batch too, so expert devices never duplicate dense work).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

MESH_AXES = ("data", "fsdp", "tensor", "expert")
BATCH_AXES = ("data", "fsdp", "expert")


def dcn_size(axis_sizes: Mapping[str, int]) -> int:
    """`mesh.dcn_data`: the slices (granules joined by the data-center network) that split
    the batch, 1 without it. Raises ValueError naming the field."""
    dcn = axis_sizes.get("dcn_data", 1)
    if not isinstance(dcn, int) or isinstance(dcn, bool) or dcn < 1:
        raise ValueError(f"config.mesh.dcn_data={dcn!r} must be a positive int (slices)")
    return dcn


def mesh_shape(axis_sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Resolve the mesh axes (`config.mesh`: one may be -1) to sizes whose product is
    num_devices. Raises ValueError naming the field.

    With `mesh.dcn_data` = D > 1 slices, the axes describe one slice (num_devices / D
    devices) and the returned `data` is D times the slice's: the batch splits over the
    slices first, then within each (`make_mesh`)."""
    dcn = dcn_size(axis_sizes)
    if num_devices % dcn:
        raise ValueError(f"config.mesh.dcn_data={dcn} does not divide the {num_devices} devices")
    sizes = _slice_shape(axis_sizes, num_devices // dcn)
    sizes["data"] *= dcn
    return sizes


def _slice_shape(axis_sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """`mesh_shape` within one slice of `num_devices` devices."""
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


def make_mesh(
    axis_sizes: dict[str, int], devices: Sequence[jax.Device] | None = None, dcn_data: int = 1
) -> Mesh:
    """A mesh with MESH_AXES of the given (resolved, positive) sizes over `devices`.

    `dcn_data` > 1 (multi-slice): `data` = dcn_data x the slice's data; each slice (devices
    by `slice_index`; by process where devices have none, as on CPU) holds a contiguous
    block of the data axis, so only the data axis's collectives cross the data-center
    network (`mesh_utils.create_hybrid_device_mesh`, as MaxText's dcn_* axes).

    Axis types are Auto: ordinary tensor-parallel code under Explicit axes fails with
    "Contracting dimensions are sharded" (docs/jax_notes.md).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(int(axis_sizes[a]) for a in MESH_AXES)
    if int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, shape))} needs {np.prod(shape)} devices, got {len(devices)}"
        )
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if dcn_data == 1:
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    granule = "slice_index" if hasattr(devices[0], "slice_index") else "process_index"
    found = len({getattr(d, granule) for d in devices})
    if shape[0] % dcn_data or found != dcn_data:
        raise ValueError(
            f"config.mesh.dcn_data={dcn_data}: the devices form {found} slices "
            f"(by {granule}) and the data axis is {shape[0]}"
        )
    ici = (shape[0] // dcn_data, *shape[1:])
    grid = mesh_utils.create_hybrid_device_mesh(
        ici,
        (dcn_data, 1, 1, 1),
        devices,
        process_is_granule=granule == "process_index",
        allow_split_physical_axes=True,
    )
    return Mesh(grid, MESH_AXES, axis_types=auto)
