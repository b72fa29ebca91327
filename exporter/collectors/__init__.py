"""Pure collectors: each turns an injected source into fresh metric families per scrape."""
