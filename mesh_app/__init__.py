"""The mesh application: the ``mesh`` command and the embedded local mesh.

This is where the layers are put together: it imports ``protocol``, the ``mesh`` runtime and
SDK, and the nodes in ``edge_node`` and ``cloud_node``. Nothing imports it, so the arrows run one
way: protocol <- mesh <- edge_node, cloud_node <- mesh_app.
"""
