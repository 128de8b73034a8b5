"""Conformance suites, one per hook family. A plugin's tests subclass the suite for each
family it implements and override only the factory fixture(s); see each module's docstring.

========================  ==========================================  ==========================
hook family               suite                                       factory to override
========================  ==========================================  ==========================
deepinfer_probe/platform  ``testing.platform.PlatformSuite``          ``platform``
attention                 ``testing.attention.AttentionBackendSuite`` ``backend``, ``platform``
MoE dispatch              ``testing.moe.MoEDispatcherSuite``          ``dispatcher``, ``platform``
MoE, expert parallel      ``testing.ep.ExpertParallelSuite``          ``dispatcher_factory``
KV storage                ``testing.kv_store.KVStoreSuite``           ``make_store``
protocol codecs           ``testing.codecs.ProtocolCodecSuite``       ``codec``
prompt encodings          ``testing.codecs.PromptEncodingSuite``      ``encoding``
speculative policies      ``testing.speculative.VerificationPolicySuite`` ``policy``
models                    ``testing.models.ModelRegistrySuite``       ``plugin``
========================  ==========================================  ==========================
"""

__all__ = []
