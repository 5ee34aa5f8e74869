"""vLLM's encoder-cache (EC) connector interface, for tests that cannot install vLLM: written
here from vLLM's own definitions, read through the search index (vllm-project/vllm:
vllm/distributed/ec_transfer/ec_connector/base.py and factory.py, vllm/config/ec_transfer.py,
vllm/v1/outputs.py, vllm/multimodal/inputs.py, the scheduler's _try_schedule_encoder_inputs
and the worker's ec_connector_model_runner_mixin.py / gpu_model_runner.py, as of the
releases after v0.16 whose ECConnectorBase sets is_consumer and whose ECTransferConfig takes
ec_both), reduced to what a connector meets. install() registers the modules under their real
names in sys.modules, so that kvtier.vllm subclasses ECConnectorBase as it would vLLM's; call
it before importing kvtier.vllm.

    ECConnectorBase, ECConnectorRole, ECConnectorMetadata    the base class as vLLM's
    ECTransferConfig    --ec-transfer-config: ec_connector, ec_role (ec_producer,
                        ec_consumer, ec_both), ec_connector_extra_config,
                        ec_connector_module_path
    create_connector()  ECConnectorFactory: a name not registered is the class of that name
                        in ec_connector_module_path; cls(vllm_config, role)
    Scheduler           the scheduler's calls for the encoder inputs of each request:
                        ensure_cache_available for waiting requests (False: deferred),
                        has_cache_item per item not in the local encoder cache (True: loaded
                        instead of computed, no encoder budget), update_state_after_alloc for
                        those, build_connector_meta once per step into the SchedulerOutput,
                        update_connector_output with the workers' output, request_finished
    Worker              the model runner's: a producer-only worker runs the encoder for the
                        scheduled items and save_caches each; a consumer binds the metadata,
                        start_load_caches(encoder_cache) before the encoder and the gather,
                        then get_finished and clear_connector_metadata; the gather asserts
                        that every scheduled item is in encoder_cache, as vLLM does
"""

import abc
import dataclasses
import enum
import importlib
import uuid
from typing import Any, Optional

import torch

BASE = "vllm.distributed.ec_transfer.ec_connector.base"
CONFIG = "vllm.config.ec_transfer"
OUTPUTS = "vllm.v1.outputs"


class ECConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class ECConnectorMetadata(abc.ABC):  # noqa: B024
    """Abstract metadata from the scheduler's connector to the workers'."""


@dataclasses.dataclass
class ECConnectorOutput:
    finished_sending: Optional[set] = None       # [mm_hash]
    finished_recving: Optional[set] = None


@dataclasses.dataclass
class ECTransferConfig:
    ec_connector: Optional[str] = None
    engine_id: Optional[str] = None
    ec_buffer_device: Optional[str] = "cuda"
    ec_buffer_size: float = 1e9
    ec_role: Optional[str] = None
    ec_rank: Optional[int] = None
    ec_parallel_size: int = 1
    ec_ip: str = "127.0.0.1"
    ec_port: int = 14579
    ec_connector_extra_config: dict = dataclasses.field(default_factory=dict)
    ec_connector_module_path: Optional[str] = None

    def __post_init__(self):
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        if self.ec_role is not None and self.ec_role not in ("ec_producer", "ec_consumer",
                                                               "ec_both"):
            raise ValueError("Unsupported ec_role: %s" % self.ec_role)
        if self.ec_connector is not None and self.ec_role is None:
            raise ValueError("Please specify ec_role when ec_connector is set")

    @property
    def is_ec_transfer_instance(self):
        return self.ec_connector is not None and self.ec_role is not None

    @property
    def is_ec_producer(self):
        return self.ec_connector is not None and self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_ec_consumer(self):
        return self.ec_connector is not None and self.ec_role in ("ec_consumer", "ec_both")

    def get_from_extra_config(self, key, default):
        return self.ec_connector_extra_config.get(key, default)


@dataclasses.dataclass
class ModelConfig:
    model: str = "test/vl-model"
    dtype: Any = torch.bfloat16
    hidden_size: int = 64

    def get_hidden_size(self):
        return self.hidden_size


@dataclasses.dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    rank: int = 0


@dataclasses.dataclass
class VllmConfig:
    model_config: ModelConfig
    ec_transfer_config: Optional[ECTransferConfig]
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)


class ECConnectorBase(abc.ABC):
    """vLLM's ECConnectorBase (the releases with is_consumer)."""

    def __init__(self, vllm_config, role):
        self._connector_metadata = None
        self._vllm_config = vllm_config
        self._role = role
        if vllm_config.ec_transfer_config is not None:
            self._is_producer = vllm_config.ec_transfer_config.is_ec_producer
            self._is_consumer = vllm_config.ec_transfer_config.is_ec_consumer
        else:
            raise ValueError("ec_transfer_config must be set for ECConnectorBase")

    @property
    def role(self):
        return self._role

    @property
    def is_producer(self):
        return self._is_producer

    @property
    def is_consumer(self):
        return self._is_consumer

    # worker side
    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def _get_connector_metadata(self):
        assert self._connector_metadata is not None
        return self._connector_metadata

    def register_caches(self, ec_caches):
        return

    @abc.abstractmethod
    def start_load_caches(self, encoder_cache, **kwargs):
        pass

    @abc.abstractmethod
    def save_caches(self, encoder_cache, mm_hash, **kwargs):
        pass

    def get_finished(self, finished_req_ids):
        return None, None

    def build_connector_worker_meta(self):
        return None

    def shutdown(self):
        return None

    # scheduler side
    @abc.abstractmethod
    def has_cache_item(self, identifier):
        pass

    def ensure_cache_available(self, request, num_computed_tokens):
        return True

    @abc.abstractmethod
    def update_state_after_alloc(self, request, index):
        pass

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output):
        pass

    def update_connector_output(self, connector_output):
        return

    def request_finished(self, request):
        return False, None


@dataclasses.dataclass(frozen=True)
class PlaceholderRange:
    offset: int
    length: int
    is_embed: Optional[torch.Tensor] = None

    def get_num_embeds(self):
        if self.is_embed is None:
            return self.length
        return int(self.is_embed.sum())


@dataclasses.dataclass
class MultiModalFeatureSpec:
    data: Any
    modality: str
    identifier: str            # the encoder cache's key (mm_hash, with a LoRA prefix if any)
    mm_position: PlaceholderRange
    mm_hash: Optional[str] = None


@dataclasses.dataclass
class Request:
    request_id: str
    mm_features: list
    num_computed_tokens: int = 0

    def get_num_encoder_embeds(self, input_id):
        return self.mm_features[input_id].mm_position.get_num_embeds()


@dataclasses.dataclass
class SchedulerOutput:
    step: int
    scheduled: dict            # request_id -> [(mm_feature, "load" | "compute")]
    finished_req_ids: set = dataclasses.field(default_factory=set)
    ec_connector_metadata: Any = None


def install():
    """Registers the interface modules under vLLM's names (idempotent)."""
    from kvtest import install_module
    for modname, names in ((BASE, ("ECConnectorBase", "ECConnectorRole",
                                   "ECConnectorMetadata")),
                           (CONFIG, ("ECTransferConfig",)),
                           (OUTPUTS, ("ECConnectorOutput",))):
        install_module(modname, {n: globals()[n] for n in names})


def vllm_config(role, extra=None, model="test/vl-model", dtype=torch.bfloat16, hidden=64,
                module="kvtier.vllm", name="KvtierECConnector", tp_size=1, rank=0):
    """--ec-transfer-config '{"ec_connector": name, "ec_role": role,
    "ec_connector_module_path": module, "ec_connector_extra_config": extra}'."""
    return VllmConfig(ModelConfig(model, dtype, hidden),
                      ECTransferConfig(ec_connector=name, ec_role=role,
                                       ec_connector_module_path=module,
                                       ec_connector_extra_config=dict(extra or {})),
                      ParallelConfig(tp_size, rank))


def create_connector(config, role):
    """ECConnectorFactory.create_connector for a connector loaded by module path."""
    tc = config.ec_transfer_config
    cls = getattr(importlib.import_module(tc.ec_connector_module_path), tc.ec_connector)
    assert issubclass(cls, ECConnectorBase), cls
    return cls(config, role)


def feature(mm_hash, offset, length):
    return MultiModalFeatureSpec(data=None, modality="image", identifier=mm_hash,
                                 mm_position=PlaceholderRange(offset, length), mm_hash=mm_hash)


class Scheduler:
    """The scheduler's EC connector calls (v1/core/sched/scheduler.py)."""

    def __init__(self, config, calls_update_output=True):
        self.connector = create_connector(config, ECConnectorRole.SCHEDULER)
        self.cached = set()          # the engine's own encoder cache (identifiers)
        self.step = 0
        self.calls_update_output = calls_update_output

    def schedule(self, requests):
        """One step over waiting requests: -> (SchedulerOutput, deferred request ids)."""
        self.step += 1
        scheduled, deferred = {}, []
        ec = self.connector
        for req in requests:
            if req.mm_features and not ec.ensure_cache_available(req, req.num_computed_tokens):
                deferred.append(req.request_id)
                continue
            items, external = [], []
            for i, f in enumerate(req.mm_features):
                if f.identifier in self.cached:
                    continue
                if ec.has_cache_item(f.identifier):
                    external.append(i)
                    items.append((f, "load"))
                else:
                    items.append((f, "compute"))
            for i in external:
                ec.update_state_after_alloc(req, i)
            scheduled[req.request_id] = items
        out = SchedulerOutput(self.step, scheduled)
        out.ec_connector_metadata = ec.build_connector_meta(out)
        return out, deferred

    def update_from_output(self, scheduler_output, ec_output):
        for items in scheduler_output.scheduled.values():
            for f, _ in items:
                self.cached.add(f.identifier)
        if self.calls_update_output and ec_output is not None:
            self.connector.update_connector_output(ec_output)

    def finish(self, request):
        return self.connector.request_finished(request)


class Worker:
    """One model runner (a TP rank) with its own encoder cache (mm_hash -> tensor)."""

    def __init__(self, config, encoder, device="cpu"):
        self.connector = create_connector(config, ECConnectorRole.WORKER)
        self.encoder = encoder       # feature -> tensor (num_embeds, hidden)
        self.encoder_cache = {}
        self.device = device
        self.computed = []           # identifiers the encoder ran for

    def execute(self, scheduler_output):
        """-> ECConnectorOutput. Raises AssertionError, as vLLM's gather does, when an item
        scheduled for loading is not in the encoder cache."""
        ec = self.connector
        out = ECConnectorOutput()
        ec.bind_connector_metadata(scheduler_output.ec_connector_metadata)
        try:
            if ec.is_consumer:
                ec.start_load_caches(self.encoder_cache)
            for items in scheduler_output.scheduled.values():
                for f, how in items:
                    if how == "compute" and f.identifier not in self.encoder_cache:
                        self.encoder_cache[f.identifier] = self.encoder(f).to(self.device)
                        self.computed.append(f.identifier)
                        if ec.is_producer:
                            ec.save_caches(encoder_cache=self.encoder_cache,
                                           mm_hash=f.identifier)
            if ec.is_consumer:       # _gather_mm_embeddings
                for items in scheduler_output.scheduled.values():
                    for f, _ in items:
                        got = self.encoder_cache.get(f.identifier)
                        assert got is not None, "Encoder cache miss for %s." % f.identifier
                        assert got.shape[0] == f.mm_position.get_num_embeds(), got.shape
        finally:
            out.finished_sending, out.finished_recving = ec.get_finished(
                scheduler_output.finished_req_ids)
            ec.clear_connector_metadata()
        return out
