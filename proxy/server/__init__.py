"""The proxy process: the aiohttp app (`app`), the routes agents call and the control API (`agent_routes`,
`control_routes`), one call captured end to end (`pipeline`, `streaming`), how answers reach the agent
(`delivery`), and the connection budgets and read limits (`connections`, `limits`). Everything else in the proxy
sits below it; nothing imports it but the faces."""
