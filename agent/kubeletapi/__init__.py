"""The kubelet's gRPC APIs a DRA driver serves (and the one it reads), vendored from k8s.io/kubelet v0.36.3.

* ``dra_v1.proto``: service ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin``, which the kubelet calls
  when the plugin registers with ``v1.DRAPlugin`` in its supported versions;
* ``drahealth_v1alpha1.proto``: service ``v1alpha1.DRAResourceHealth``, the device health stream
  the kubelet opens on the same socket;
* ``pluginregistration_v1.proto``: service ``pluginregistration.Registration``;
* ``podresources_v1.proto``: service ``v1.PodResourcesLister``, which the kubelet serves (on
  ``<kubelet root>/pod-resources/kubelet.sock``) to say which devices each container has, DRA
  claims' CDI devices included; the local real node's tests read it.

Their ``*_pb2`` modules are generated when gpualloc is installed (``setup.py``), not committed.
"""
