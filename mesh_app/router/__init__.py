"""``mesh router``: training, evaluating and scoring the edge's learned router, as a tool.

The edge runs only what scores a prompt (``edge_node.learned``: features, model, router and
the shipped weights). What builds and judges the weights lives here, where the edge never
imports it: the labelled routing data (:mod:`.data`), training (:mod:`.train`), RouteLLM-style
evaluation (:mod:`.evaluate`) and the commands themselves (:mod:`.commands`).
"""
