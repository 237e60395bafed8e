// Command grpc-client talks to a DRA plugin's sockets with grpc-go, the library the kubelet is built
// on, and dials them the way the kubelet does: an imitation of the kubelet's client in another
// library cannot show how grpc-go's requests are received.
//
//	grpc-client register <registration socket>          GetInfo, then NotifyRegistrationStatus{registered}
//	grpc-client register-encoded <registration socket>  the same with the path percent-encoded
//	grpc-client dra <DRA socket>                        first NodeWatchResources answer, NodeUnprepareResources{}
//	grpc-client authority <mode> <dir>                  the :authority that mode's dial puts on the wire
//
// grpc-go up to 1.56 sends the registration socket's path as it is; from 1.57 on it percent-encodes
// it (%2Fvar%2Flib%2F...), and kubelets built with those send that. The installed grpc-go is older,
// so register-encoded sets that authority itself: a server must take both.
//
// Results are one JSON object on stdout; an RPC failure is printed on stderr with grpc-go's own
// wording and exits 1.
//
// Built offline in GOPATH mode against Debian's golang-google-grpc-dev (grpc-go 1.33), which has no
// google.golang.org/protobuf: the few messages are encoded by hand with their field numbers.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
)

// The kubelet's own limits: 10 s to dial a plugin and for each registration call.
const callTimeout = 10 * time.Second

func main() {
	if len(os.Args) < 3 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "register":
		err = register(os.Args[2], dialRegistration)
	case "register-encoded":
		err = register(os.Args[2], dialRegistrationEncoded)
	case "dra":
		err = dra(os.Args[2])
	case "authority":
		if len(os.Args) < 4 {
			usage()
		}
		err = authority(os.Args[2], os.Args[3])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: grpc-client register|register-encoded|dra <socket> | authority register|register-encoded|dra <dir>")
	os.Exit(2)
}

// dialUnix ignores the network grpc-go would pick for the address: every kubelet socket is a Unix
// socket. grpc-go 1.33 hands a `unix:` target to the dialer as it is, newer ones strip the scheme.
func dialUnix(ctx context.Context, addr string) (net.Conn, error) {
	return (&net.Dialer{}).DialContext(ctx, "unix", strings.TrimPrefix(addr, "unix:"))
}

// dialRegistration is the kubelet's plugin watcher: the bare socket path is the target, so grpc-go
// uses that path as the :authority of every request.
func dialRegistration(ctx context.Context, socket string) (*grpc.ClientConn, error) {
	return grpc.DialContext(ctx, socket, grpc.WithInsecure(), grpc.WithBlock(), grpc.WithContextDialer(dialUnix))
}

// dialRegistrationEncoded is the plugin watcher of a kubelet built with grpc-go 1.57 or later,
// which percent-encodes that path into the :authority.
func dialRegistrationEncoded(ctx context.Context, socket string) (*grpc.ClientConn, error) {
	return grpc.DialContext(ctx, socket, grpc.WithInsecure(), grpc.WithBlock(), grpc.WithContextDialer(dialUnix),
		grpc.WithAuthority(encodeAuthority(socket)))
}

// encodeAuthority percent-encodes every byte that RFC 3986 does not allow in an authority, as
// grpc-go 1.57+ does with a target's endpoint.
func encodeAuthority(authority string) string {
	var b strings.Builder
	for i := 0; i < len(authority); i++ {
		c := authority[i]
		if 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' ||
			strings.IndexByte("-_.~!$&'()*+,;=:[]@", c) >= 0 {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// dialDRA is the kubelet's DRA client: a `unix:` target, which grpc-go sends as `localhost`.
func dialDRA(ctx context.Context, socket string) (*grpc.ClientConn, error) {
	return grpc.DialContext(ctx, "unix:"+socket, grpc.WithInsecure(), grpc.WithBlock(), grpc.WithContextDialer(dialUnix))
}

type pluginInfo struct {
	Type              string   `json:"type"`
	Name              string   `json:"name"`
	Endpoint          string   `json:"endpoint"`
	SupportedVersions []string `json:"supported_versions"`
}

func register(socket string, dial func(context.Context, string) (*grpc.ClientConn, error)) error {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	conn, err := dial(ctx, socket)
	if err != nil {
		return fmt.Errorf("dial %s: %w", socket, err)
	}
	defer conn.Close()

	var reply []byte
	if err := invoke(ctx, conn, "/pluginregistration.Registration/GetInfo", nil, &reply); err != nil {
		return fmt.Errorf("GetInfo: %w", err)
	}
	info := pluginInfo{SupportedVersions: []string{}}
	err = eachField(reply, func(f field) error {
		switch f.num {
		case 1:
			info.Type = string(f.bytes)
		case 2:
			info.Name = string(f.bytes)
		case 3:
			info.Endpoint = string(f.bytes)
		case 4:
			info.SupportedVersions = append(info.SupportedVersions, string(f.bytes))
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("GetInfo: decoding PluginInfo: %w", err)
	}
	// RegistrationStatus{plugin_registered: true}
	status := appendVarint(appendTag(nil, 1, wireVarint), 1)
	if err := invoke(ctx, conn, "/pluginregistration.Registration/NotifyRegistrationStatus", status, &reply); err != nil {
		return fmt.Errorf("NotifyRegistrationStatus: %w", err)
	}
	return printJSON(info)
}

type deviceHealth struct {
	PoolName                  string `json:"pool_name"`
	DeviceName                string `json:"device_name"`
	Health                    string `json:"health"`
	LastUpdatedTime           int64  `json:"last_updated_time"`
	HealthCheckTimeoutSeconds int64  `json:"health_check_timeout_seconds"`
	Message                   string `json:"message"`
}

type draResult struct {
	Health    []deviceHealth    `json:"health"`
	Unprepare map[string]string `json:"unprepare"`
}

var healthNames = map[uint64]string{0: "UNKNOWN", 1: "HEALTHY", 2: "UNHEALTHY"}

func dra(socket string) error {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	conn, err := dialDRA(ctx, socket)
	if err != nil {
		return fmt.Errorf("dial unix:%s: %w", socket, err)
	}
	defer conn.Close()

	result := draResult{Health: []deviceHealth{}, Unprepare: map[string]string{}}
	if result.Health, err = firstHealth(ctx, conn); err != nil {
		return fmt.Errorf("NodeWatchResources: %w", err)
	}

	// NodeUnprepareResourcesRequest{claims: []}: what the kubelet sends carries claims, but an empty
	// list must be answered too, and needs no claim in the API server.
	var reply []byte
	if err := invoke(ctx, conn, "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources", nil, &reply); err != nil {
		return fmt.Errorf("NodeUnprepareResources: %w", err)
	}
	err = eachField(reply, func(entry field) error {
		if entry.num != 1 {
			return nil
		}
		var uid, claimErr string
		err := eachField(entry.bytes, func(f field) error {
			switch f.num {
			case 1:
				uid = string(f.bytes)
			case 2:
				return eachField(f.bytes, func(g field) error {
					if g.num == 1 {
						claimErr = string(g.bytes)
					}
					return nil
				})
			}
			return nil
		})
		result.Unprepare[uid] = claimErr
		return err
	})
	if err != nil {
		return fmt.Errorf("NodeUnprepareResources: decoding the response: %w", err)
	}
	return printJSON(result)
}

func firstHealth(ctx context.Context, conn *grpc.ClientConn) ([]deviceHealth, error) {
	ctx, cancel := context.WithCancel(ctx)
	// Cancelling is how the kubelet ends the stream too.
	defer cancel()
	stream, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true},
		"/v1alpha1.DRAResourceHealth/NodeWatchResources", grpc.ForceCodec(rawCodec{}))
	if err != nil {
		return nil, err
	}
	if err := stream.SendMsg([]byte(nil)); err != nil {
		return nil, err
	}
	if err := stream.CloseSend(); err != nil {
		return nil, err
	}
	var msg []byte
	if err := stream.RecvMsg(&msg); err != nil {
		return nil, err
	}
	devices := []deviceHealth{}
	err = eachField(msg, func(d field) error {
		if d.num != 1 {
			return nil
		}
		var h deviceHealth
		err := eachField(d.bytes, func(f field) error {
			switch f.num {
			case 1:
				return eachField(f.bytes, func(id field) error {
					switch id.num {
					case 1:
						h.PoolName = string(id.bytes)
					case 2:
						h.DeviceName = string(id.bytes)
					}
					return nil
				})
			case 2:
				h.Health = healthNames[f.varint]
				if h.Health == "" {
					h.Health = fmt.Sprint(f.varint)
				}
			case 3:
				h.LastUpdatedTime = int64(f.varint)
			case 4:
				h.HealthCheckTimeoutSeconds = int64(f.varint)
			case 5:
				h.Message = string(f.bytes)
			}
			return nil
		})
		devices = append(devices, h)
		return err
	})
	return devices, err
}

// authority answers which :authority a mode's dial sends: it listens on <dir>/probe.sock, dials it
// as that mode does and reads the first request's headers off the wire. It pins down what grpc-go
// itself does, so a test of the server relies on the client being the kubelet's equal.
func authority(mode, dir string) error {
	socket := filepath.Join(dir, "probe.sock")
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return err
	}
	defer listener.Close()
	seen := make(chan string, 1)
	go func() {
		conn, err := listener.Accept()
		if err != nil {
			seen <- "accept: " + err.Error()
			return
		}
		defer conn.Close()
		seen <- firstAuthority(conn)
	}()

	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	var dial func(context.Context, string) (*grpc.ClientConn, error)
	var target string
	switch mode {
	case "register":
		dial, target = dialRegistration, socket
	case "register-encoded":
		dial, target = dialRegistrationEncoded, socket
	case "dra":
		dial, target = dialDRA, "unix:"+socket
	default:
		usage()
	}
	go func() {
		conn, err := dial(ctx, socket)
		if err != nil {
			return
		}
		defer conn.Close()
		var reply []byte
		_ = invoke(ctx, conn, "/probe.Probe/Call", nil, &reply)
	}()
	select {
	case got := <-seen:
		return printJSON(map[string]string{"target": target, "authority": got})
	case <-ctx.Done():
		return errors.New("no request arrived")
	}
}

// firstAuthority plays the server's side of the connection preface (grpc-go waits for the server's
// SETTINGS before it sends a request) and returns the :authority of the first HEADERS frame.
func firstAuthority(conn net.Conn) string {
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(conn, preface); err != nil {
		return "reading the preface: " + err.Error()
	}
	framer := http2.NewFramer(conn, conn)
	if err := framer.WriteSettings(); err != nil {
		return "writing SETTINGS: " + err.Error()
	}
	authority := "<no :authority>"
	decoder := hpack.NewDecoder(4096, func(f hpack.HeaderField) {
		if f.Name == ":authority" {
			authority = f.Value
		}
	})
	for {
		frame, err := framer.ReadFrame()
		if err != nil {
			return "reading frames: " + err.Error()
		}
		switch frame := frame.(type) {
		case *http2.SettingsFrame:
			if !frame.IsAck() {
				_ = framer.WriteSettingsAck()
			}
		case *http2.HeadersFrame:
			if _, err := decoder.Write(frame.HeaderBlockFragment()); err != nil {
				return "decoding headers: " + err.Error()
			}
			return authority
		}
	}
}

func invoke(ctx context.Context, conn *grpc.ClientConn, method string, request []byte, reply *[]byte) error {
	return conn.Invoke(ctx, method, request, reply, grpc.ForceCodec(rawCodec{}))
}

func printJSON(v interface{}) error {
	out, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Println(string(out))
	return err
}

// rawCodec passes protobuf bytes through: requests are []byte, replies land in a *[]byte.
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) {
	switch v := v.(type) {
	case []byte:
		return v, nil
	case *[]byte:
		return *v, nil
	}
	return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
}

func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	out, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	*out = append([]byte(nil), data...)
	return nil
}

// The name decides nothing: ForceCodec keeps the content-type application/grpc, as protobuf sends.
func (rawCodec) Name() string { return "proto" }

const (
	wireVarint  = 0
	wireFixed64 = 1
	wireBytes   = 2
	wireFixed32 = 5
)

type field struct {
	num    uint64
	varint uint64
	bytes  []byte
}

func appendTag(b []byte, num, wire uint64) []byte { return appendVarint(b, num<<3|wire) }

func appendVarint(b []byte, v uint64) []byte {
	for v >= 0x80 {
		b = append(b, byte(v)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

func readVarint(b []byte) (uint64, int, error) {
	var v uint64
	for i := 0; i < len(b) && i < 10; i++ {
		v |= uint64(b[i]&0x7f) << (7 * i)
		if b[i] < 0x80 {
			return v, i + 1, nil
		}
	}
	return 0, 0, errors.New("truncated varint")
}

// eachField walks one message's fields in wire order; fields of other wire types are skipped.
func eachField(b []byte, visit func(field) error) error {
	for len(b) > 0 {
		tag, n, err := readVarint(b)
		if err != nil {
			return err
		}
		b = b[n:]
		f := field{num: tag >> 3}
		switch tag & 7 {
		case wireVarint:
			if f.varint, n, err = readVarint(b); err != nil {
				return err
			}
		case wireBytes:
			size, m, err := readVarint(b)
			if err != nil {
				return err
			}
			if size > uint64(len(b)-m) {
				return fmt.Errorf("field %d: %d bytes announced, %d left", f.num, size, len(b)-m)
			}
			f.bytes = b[m : m+int(size)]
			n = m + int(size)
		case wireFixed64:
			n = 8
		case wireFixed32:
			n = 4
		default:
			return fmt.Errorf("field %d: unsupported wire type %d", f.num, tag&7)
		}
		if n > len(b) {
			return fmt.Errorf("field %d: truncated", f.num)
		}
		b = b[n:]
		if err := visit(f); err != nil {
			return err
		}
	}
	return nil
}
