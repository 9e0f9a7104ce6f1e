package client

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"strconv"
)

// Limits on what the agent may answer. The agent's answers are small
// JSON documents; the largest is the endpoint list of a full node.
const (
	maxBody       = 16 << 20 // bytes of one answer's body
	maxHeaderLine = 8 << 10  // bytes of the status line or one header line
	maxHeaders    = 100      // header lines of one answer
)

// errMalformed marks an answer that is not the HTTP/1.1 the agent's
// server speaks: the connection it came on is not used again.
var errMalformed = errors.New("malformed HTTP answer")

// response is one HTTP/1.1 answer, its body read whole.
type response struct {
	status int
	// statusLine is the status line without its protocol version,
	// "404 Not Found", for messages.
	statusLine string
	body       []byte
	// keepAlive says the connection may carry another request: the body
	// was delimited (by Content-Length or chunks) and neither side asked
	// to close.
	keepAlive bool
}

// header is what the client reads from an answer's header lines.
type header struct {
	contentLength int64 // -1 when absent
	chunked       bool
	close         bool
}

// readResponse reads one answer from br: the status line, the header
// lines and the body (Content-Length, chunked, or up to EOF). Interim
// 1xx answers are skipped. Every malformed or cut-short answer is an
// error; none panics.
func readResponse(br *bufio.Reader) (*response, error) {
	for {
		line, err := readLine(br)
		if err != nil {
			return nil, fmt.Errorf("read status line: %w", err)
		}
		proto, status, text, err := parseStatusLine(line)
		if err != nil {
			return nil, err
		}
		h, err := readHeader(br)
		if err != nil {
			return nil, err
		}
		if status >= 100 && status < 200 && status != 101 {
			continue // 100 Continue, 103 Early Hints: the answer follows
		}
		r := &response{status: status, statusLine: text, keepAlive: proto == "HTTP/1.1" && !h.close}
		r.body, r.keepAlive, err = readBody(br, status, h, r.keepAlive)
		if err != nil {
			return nil, err
		}
		return r, nil
	}
}

// parseStatusLine splits "HTTP/1.1 200 OK" into its version, its code
// and "200 OK".
func parseStatusLine(line []byte) (proto string, status int, text string, err error) {
	p, rest, ok := bytes.Cut(line, []byte(" "))
	if !ok || (string(p) != "HTTP/1.1" && string(p) != "HTTP/1.0") {
		return "", 0, "", fmt.Errorf("%w: status line %q", errMalformed, clip(line))
	}
	code, _, _ := bytes.Cut(rest, []byte(" "))
	if len(code) != 3 || code[0] < '1' || code[0] > '5' || !isDigits(code) {
		return "", 0, "", fmt.Errorf("%w: status code in %q", errMalformed, clip(line))
	}
	status, _ = strconv.Atoi(string(code))
	return string(p), status, string(bytes.TrimSpace(rest)), nil
}

// readHeader reads header lines up to the empty line and keeps the
// three that frame the body.
func readHeader(br *bufio.Reader) (header, error) {
	h := header{contentLength: -1}
	for n := 0; ; n++ {
		line, err := readLine(br)
		if err != nil {
			return h, fmt.Errorf("read header: %w", err)
		}
		if len(line) == 0 {
			return h, nil
		}
		if n == maxHeaders {
			return h, fmt.Errorf("%w: more than %d header lines", errMalformed, maxHeaders)
		}
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok || len(name) == 0 || name[0] == ' ' || name[0] == '\t' {
			return h, fmt.Errorf("%w: header line %q", errMalformed, clip(line))
		}
		value = bytes.TrimSpace(value)
		switch {
		case bytes.EqualFold(name, []byte("Content-Length")):
			n, err := parseLength(value)
			if err != nil || (h.contentLength >= 0 && h.contentLength != n) {
				return h, fmt.Errorf("%w: Content-Length %q", errMalformed, clip(value))
			}
			h.contentLength = n
		case bytes.EqualFold(name, []byte("Transfer-Encoding")):
			if !bytes.EqualFold(value, []byte("chunked")) {
				return h, fmt.Errorf("%w: Transfer-Encoding %q", errMalformed, clip(value))
			}
			h.chunked = true
		case bytes.EqualFold(name, []byte("Connection")):
			for _, tok := range bytes.Split(value, []byte(",")) {
				if bytes.EqualFold(bytes.TrimSpace(tok), []byte("close")) {
					h.close = true
				}
			}
		}
	}
}

// readBody reads the body that h frames. A body up to EOF leaves the
// connection unusable; so does one whose framing is in doubt.
func readBody(br *bufio.Reader, status int, h header, keepAlive bool) ([]byte, bool, error) {
	switch {
	case status == 204 || status == 304:
		return nil, keepAlive, nil
	case h.chunked:
		body, err := readChunked(br)
		return body, keepAlive, err
	case h.contentLength >= 0:
		if h.contentLength > maxBody {
			return nil, false, fmt.Errorf("%w: Content-Length %d is over the limit of %d", errMalformed, h.contentLength, maxBody)
		}
		body := make([]byte, h.contentLength)
		if _, err := io.ReadFull(br, body); err != nil {
			return nil, false, fmt.Errorf("read body of %d bytes: %w", h.contentLength, unexpectedEOF(err))
		}
		return body, keepAlive, nil
	default:
		body, err := io.ReadAll(io.LimitReader(br, maxBody+1))
		if err != nil {
			return nil, false, fmt.Errorf("read body: %w", err)
		}
		if len(body) > maxBody {
			return nil, false, fmt.Errorf("%w: body over the limit of %d bytes", errMalformed, maxBody)
		}
		return body, false, nil
	}
}

// readChunked reads a chunked body and the trailer after it.
func readChunked(br *bufio.Reader) ([]byte, error) {
	var body []byte
	for {
		line, err := readLine(br)
		if err != nil {
			return nil, fmt.Errorf("read chunk size: %w", unexpectedEOF(err))
		}
		size, _, _ := bytes.Cut(line, []byte(";")) // chunk extensions are ignored
		n, err := strconv.ParseUint(string(bytes.TrimSpace(size)), 16, 32)
		if err != nil {
			return nil, fmt.Errorf("%w: chunk size %q", errMalformed, clip(line))
		}
		if n == 0 {
			if _, err := readHeader(br); err != nil { // the trailer
				return nil, fmt.Errorf("chunked trailer: %w", unexpectedEOF(err))
			}
			return body, nil
		}
		if uint64(len(body))+n > maxBody {
			return nil, fmt.Errorf("%w: chunked body over the limit of %d bytes", errMalformed, maxBody)
		}
		start := len(body)
		body = append(body, make([]byte, n)...)
		if _, err := io.ReadFull(br, body[start:]); err != nil {
			return nil, fmt.Errorf("read chunk of %d bytes: %w", n, unexpectedEOF(err))
		}
		if crlf, err := readLine(br); err != nil || len(crlf) != 0 {
			if err == nil {
				err = fmt.Errorf("%w: chunk of %d bytes is longer", errMalformed, n)
			}
			return nil, fmt.Errorf("end of chunk: %w", unexpectedEOF(err))
		}
	}
}

// readLine reads one line ending in LF (or CRLF) and returns it without
// the ending. EOF before the ending is io.ErrUnexpectedEOF unless
// nothing at all was read (io.EOF: the peer closed between answers).
func readLine(br *bufio.Reader) ([]byte, error) {
	var line []byte
	for {
		frag, err := br.ReadSlice('\n')
		if len(line)+len(frag) > maxHeaderLine {
			return nil, fmt.Errorf("%w: line longer than %d bytes", errMalformed, maxHeaderLine)
		}
		switch {
		case err == nil:
			line = append(line, frag...)
			line = bytes.TrimSuffix(line[:len(line)-1], []byte("\r"))
			return line, nil
		case errors.Is(err, bufio.ErrBufferFull):
			line = append(line, frag...)
		case errors.Is(err, io.EOF) && len(line)+len(frag) > 0:
			return nil, io.ErrUnexpectedEOF
		default:
			return nil, err
		}
	}
}

// parseLength parses a Content-Length: decimal digits only.
func parseLength(v []byte) (int64, error) {
	if len(v) == 0 || len(v) > 18 || !isDigits(v) {
		return 0, fmt.Errorf("%w: length %q", errMalformed, clip(v))
	}
	return strconv.ParseInt(string(v), 10, 64)
}

func isDigits(b []byte) bool {
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// unexpectedEOF says that an answer was cut short: EOF inside it is
// io.ErrUnexpectedEOF.
func unexpectedEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// clip shortens b for an error message.
func clip(b []byte) string {
	if len(b) > 64 {
		return string(b[:64]) + "..."
	}
	return string(b)
}
