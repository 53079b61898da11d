"""Pydantic models of a catalog file: one GPU model and every profile it can offer."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Provenance(_Strict):
    """Where a fact comes from; `confirmed: false` marks what NVIDIA has not published."""

    confirmed: bool = True
    note: str = ""


class VgpuTypeSpec(_Strict):
    """A time-sliced vGPU type (MIG off), e.g. A100D-10C."""

    name: str = Field(min_length=1)
    framebuffer_mib: int = Field(gt=0)
    max_equal: int = Field(gt=0, description="most vGPUs of this type on one GPU in equal-size mode")
    max_mixed: int | None = Field(default=None, gt=0, description="most in mixed-size mode; None if not offered")
    placement_size: int | None = Field(default=None, gt=0, description="units (GB) taken on the mixed-size axis")
    placement_ids: list[int] | None = None
    provenance: Provenance = Provenance()

    @model_validator(mode="after")
    def _mixed_consistent(self) -> VgpuTypeSpec:
        if self.placement_ids is not None:
            if self.placement_size is None:
                raise ValueError("placement_ids given without placement_size")
            if self.max_mixed is not None and len(self.placement_ids) != self.max_mixed:
                raise ValueError(
                    f"max_mixed is {self.max_mixed} but {len(self.placement_ids)} placement_ids are listed"
                )
            if sorted(set(self.placement_ids)) != self.placement_ids or any(p < 0 for p in self.placement_ids):
                raise ValueError("placement_ids must be distinct, non-negative and ascending")
        return self


class MigProfileSpec(_Strict):
    """A MIG GPU-instance profile, e.g. 3g.40gb."""

    name: str = Field(min_length=1)
    profile_id: int = Field(ge=0, description="NVML GPU-instance profile ID (nvidia-smi 'Profile ID')")
    nvml_index: int = Field(ge=0, description="NVML_GPU_INSTANCE_PROFILE_* constant")
    compute_slices: int = Field(gt=0)
    memory_slices: int = Field(gt=0)
    max_instances: int = Field(gt=0)
    starts: list[int] = Field(min_length=1)
    framebuffer_mib: int = Field(gt=0)
    media_extensions: bool = False
    provenance: Provenance = Provenance()

    @field_validator("starts")
    @classmethod
    def _ascending(cls, starts: list[int]) -> list[int]:
        if sorted(set(starts)) != starts or any(s < 0 for s in starts):
            raise ValueError("starts must be distinct, non-negative and ascending")
        return starts


class MigVgpuTypeSpec(_Strict):
    """A MIG-backed vGPU type: one vGPU on one GPU instance of `mig_profile`."""

    name: str = Field(min_length=1)
    framebuffer_mib: int = Field(gt=0)
    max_instances: int = Field(gt=0)
    mig_profile: str
    provenance: Provenance = Provenance()


class MigSpec(_Strict):
    """MIG geometry of a model: the memory-slice axis and its profiles."""

    memory_slices: int = Field(gt=0)
    compute_slices: int = Field(gt=0)
    max_instances: int = Field(gt=0)
    profiles: list[MigProfileSpec] = Field(min_length=1)
    vgpu_types: list[MigVgpuTypeSpec] = []
    provenance: Provenance = Provenance()

    @model_validator(mode="after")
    def _profiles_fit(self) -> MigSpec:
        names = {p.name for p in self.profiles}
        for p in self.profiles:
            if p.starts[-1] + p.memory_slices > self.memory_slices:
                raise ValueError(f"profile {p.name}: start {p.starts[-1]} + size {p.memory_slices} "
                                 f"passes the {self.memory_slices} memory slices")
            if p.compute_slices > self.compute_slices:
                raise ValueError(f"profile {p.name}: {p.compute_slices} compute slices > {self.compute_slices}")
        for v in self.vgpu_types:
            if v.mig_profile not in names:
                raise ValueError(f"vGPU type {v.name}: unknown mig_profile {v.mig_profile!r}")
        return self


class GpuModelSpec(_Strict):
    """One GPU model of the catalog."""

    model: str = Field(pattern=r"^[A-Z0-9][A-Za-z0-9-]*$")
    description: str
    memory_mib: int = Field(gt=0)
    pci_device_ids: list[str] = Field(min_length=1)
    vgpu_prefixes: list[str] = Field(default=[], description="board prefixes of vGPU type names")
    mixed_size: bool = False
    vgpu_types: list[VgpuTypeSpec] = []
    mig: MigSpec | None = None
    passthrough: bool = True
    provenance: Provenance = Provenance()

    @field_validator("pci_device_ids")
    @classmethod
    def _hex_ids(cls, ids: list[str]) -> list[str]:
        out = []
        for i in ids:
            try:
                int(i, 16)
            except ValueError:
                raise ValueError(f"PCI device id {i!r} is not hexadecimal (e.g. 0x20b5)") from None
            out.append(f"0x{int(i, 16):04x}")
        return out

    @model_validator(mode="after")
    def _axis_fits(self) -> GpuModelSpec:
        axis = self.axis_gb
        names = [t.name for t in self.vgpu_types]
        if len(set(names)) != len(names):
            raise ValueError("duplicate vGPU type names")
        for t in self.vgpu_types:
            size = t.placement_size or t.framebuffer_mib // 1024
            if size * t.max_equal > axis:
                raise ValueError(f"vGPU type {t.name}: {t.max_equal} x {size} GB passes the {axis} GB framebuffer")
            if t.placement_ids and t.placement_ids[-1] + size > axis:
                raise ValueError(f"vGPU type {t.name}: placement {t.placement_ids[-1]} + {size} passes {axis} GB")
        return self

    @property
    def axis_gb(self) -> int:
        """Length of the framebuffer axis in GB: the units of vGPU placement IDs."""
        return self.memory_mib // 1024
