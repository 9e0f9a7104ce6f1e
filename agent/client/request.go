package client

import (
	"strconv"
	"time"

	"github.com/kvipam/kvipam/agent/api"
)

// appendRequest appends one HTTP/1.1 request to buf: the request line,
// Host, the agent's timeout header when wait > 0, and with a body its
// Content-Type and Content-Length. The agent's server keeps the
// connection open for the next request.
func appendRequest(buf []byte, method, target string, body []byte, wait time.Duration) []byte {
	buf = append(buf, method...)
	buf = append(buf, ' ')
	buf = append(buf, target...)
	buf = append(buf, " HTTP/1.1\r\nHost: kvipam\r\nUser-Agent: kvipam-client\r\n"...)
	if wait > 0 {
		buf = append(buf, api.HeaderTimeout...)
		buf = append(buf, ": "...)
		buf = strconv.AppendInt(buf, wait.Milliseconds(), 10)
		buf = append(buf, "\r\n"...)
	}
	if body != nil {
		buf = append(buf, "Content-Type: application/json\r\nContent-Length: "...)
		buf = strconv.AppendInt(buf, int64(len(body)), 10)
		buf = append(buf, "\r\n"...)
	}
	buf = append(buf, "\r\n"...)
	return append(buf, body...)
}
