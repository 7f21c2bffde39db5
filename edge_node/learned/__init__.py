"""The learned stage-0 router the edge runs: prompt features, the model with its shipped weights,
and the router that scores a request (numpy only). Training, evaluation and the routing data
are the ``mesh router`` tool's (``mesh_app/router/``), which the edge never imports."""
