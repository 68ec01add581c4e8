"""The servers and how they are chosen: endpoints and clusters (`endpoints`), balancing
(`balance`, `load`, `scrape`), health checks and ejection (`health`, `outlier`), the
retry budget (`retry`), live membership and Kubernetes discovery (`membership`,
`discovery`), the model catalog (`models`) and P's coordinates (`probe`).

Imports `upstream`, `protocol` and the ground (`errors`, `config`, `metrics`)."""
