package fraud.bench;

import java.time.Duration;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;

import org.apache.kafka.common.header.internals.RecordHeaders;
import org.apache.kafka.common.serialization.Serdes;
import org.apache.kafka.streams.KafkaStreams;
import org.apache.kafka.streams.StreamsBuilder;
import org.apache.kafka.streams.StreamsConfig;
import org.apache.kafka.streams.Topology;
import org.apache.kafka.streams.errors.StreamsUncaughtExceptionHandler.StreamThreadExceptionResponse;
import org.apache.kafka.streams.kstream.Consumed;
import org.apache.kafka.streams.kstream.Produced;
import org.apache.kafka.streams.processor.api.ContextualProcessor;
import org.apache.kafka.streams.processor.api.Record;

/**
 * The benchmark's peer: Kafka Streams, exactly_once_v2, one stream thread,
 * forwarding each record of the input topic unchanged (key and value bytes) to
 * the output topic, as bench/bare.py and bench/passthrough.py do. What the
 * scoring pipeline's exactly-once loop costs is compared against it.
 *
 * <pre>
 * java -cp 'target/classes:target/lib/*' fraud.bench.PassThrough --bootstrap HOST:PORT \
 *   --input TOPIC --output TOPIC --application-id ID --state-dir DIR --commit-interval-ms MS
 * </pre>
 *
 * Prints "Ready" once its first assignment is running; on SIGTERM closes Kafka
 * Streams (committing or aborting the open transaction) before the JVM exits;
 * exits 1 if the stream thread died.
 */
public final class PassThrough {
    private static final List<String> OPTIONS = List.of(
        "bootstrap", "input", "output", "application-id", "state-dir", "commit-interval-ms");
    /** Long enough for a clean close with a transaction in flight, short enough for the bench's 10 s stop. */
    private static final Duration CLOSE_TIMEOUT = Duration.ofSeconds(5);

    private PassThrough() {
    }

    /** The topology: source, drop headers, sink. */
    static Topology topology(String input, String output) {
        StreamsBuilder builder = new StreamsBuilder();
        builder.stream(input, Consumed.with(Serdes.ByteArray(), Serdes.ByteArray()))
            // NOTE: the other pass-throughs produce key and value only; Kafka
            // Streams would copy the input's headers (the client's signature,
            // ~200 bytes) to every output record: dropped, so all write the same bytes.
            .process(() -> new ContextualProcessor<byte[], byte[], byte[], byte[]>() {
                @Override
                public void process(Record<byte[], byte[]> record) {
                    context().forward(record.withHeaders(new RecordHeaders()));
                }
            })
            .to(output, Produced.with(Serdes.ByteArray(), Serdes.ByteArray()));
        return builder.build();
    }

    static Properties config(Map<String, String> args) {
        Properties props = new Properties();
        props.put(StreamsConfig.APPLICATION_ID_CONFIG, args.get("application-id"));
        props.put(StreamsConfig.BOOTSTRAP_SERVERS_CONFIG, args.get("bootstrap"));
        props.put(StreamsConfig.STATE_DIR_CONFIG, args.get("state-dir"));
        // Read_committed consumers and one transactional producer per thread (KIP-447).
        props.put(StreamsConfig.PROCESSING_GUARANTEE_CONFIG, StreamsConfig.EXACTLY_ONCE_V2);
        // One thread, as the scoring worker has one loop: the comparison is per process.
        props.put(StreamsConfig.NUM_STREAM_THREADS_CONFIG, 1);
        // With exactly-once this is how often the transaction commits, so how long
        // an output waits before a read_committed reader sees it (default 100 ms).
        props.put(StreamsConfig.COMMIT_INTERVAL_MS_CONFIG, Long.parseLong(args.get("commit-interval-ms")));
        return props;
    }

    static Map<String, String> parse(String[] argv) {
        Map<String, String> args = new HashMap<>();
        for (int i = 0; i < argv.length; i += 2) {
            String name = argv[i].startsWith("--") ? argv[i].substring(2) : "";
            if (!OPTIONS.contains(name) || i + 1 >= argv.length) {
                throw new IllegalArgumentException("unknown option or missing value: " + argv[i]);
            }
            args.put(name, argv[i + 1]);
        }
        for (String name : OPTIONS) {
            if (!args.containsKey(name)) {
                throw new IllegalArgumentException("missing --" + name);
            }
        }
        return args;
    }

    public static void main(String[] argv) throws InterruptedException {
        Map<String, String> args;
        try {
            args = parse(argv);
        } catch (IllegalArgumentException e) {
            System.err.println("PassThrough: " + e.getMessage() + "; options: --" + String.join(" --", OPTIONS));
            System.exit(2);
            return;
        }
        KafkaStreams streams = new KafkaStreams(topology(args.get("input"), args.get("output")), config(args));
        CountDownLatch stopped = new CountDownLatch(1);
        AtomicInteger exitCode = new AtomicInteger(0);
        AtomicBoolean ready = new AtomicBoolean(false);
        streams.setStateListener((now, before) -> {
            if (now == KafkaStreams.State.RUNNING && ready.compareAndSet(false, true)) {
                System.out.println("Ready: Kafka Streams exactly_once_v2 pass-through "
                    + args.get("input") + " -> " + args.get("output")
                    + ", commit.interval.ms=" + args.get("commit-interval-ms"));
                System.out.flush();
            } else if (now == KafkaStreams.State.ERROR) {
                exitCode.set(1);
                stopped.countDown();
            }
        });
        // A dead thread ends the process: the bench sees it exit, not a silent stall.
        streams.setUncaughtExceptionHandler(e -> {
            System.err.println("PassThrough: stream thread failed: " + e);
            return StreamThreadExceptionResponse.SHUTDOWN_CLIENT;
        });
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            streams.close(CLOSE_TIMEOUT);
            stopped.countDown();
        }, "pass-through-shutdown"));
        streams.start();
        stopped.await();
        streams.close(CLOSE_TIMEOUT);
        System.exit(exitCode.get());
    }
}
