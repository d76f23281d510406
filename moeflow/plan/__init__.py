"""moeflow plan: the deployment search over the simulator (candidates, their SLO search, the serve command)."""
